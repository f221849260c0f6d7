//! The cache file: one preallocated file in a private directory, locked by one process.
//!
//! Invariants:
//! - The directory is created 0700 and the file 0600 (an existing file is narrowed to 0600).
//! - An exclusive `flock` is held for the file's lifetime: a second process (or a second open in
//!   this one) gets [`DiskError::Locked`], never a shared file. A lock still held is waited for up
//!   to [`CacheFileOptions::lock_wait`] (a process that just died may still hold it while the
//!   kernel tears down its io_uring), then reported with the time waited.
//! - Nothing here follows a planted link or uses someone else's file: the name is one plain path
//!   component (no `/`, no `..`), the file is opened with `O_NOFOLLOW` relative to the checked
//!   directory's descriptor, and it must be a regular file owned by this user with a single
//!   link; a directory that other users may write into without the sticky bit is refused (they
//!   could swap the file).
//! - The directory: no link is followed on any component kvbm creates, nor on the last
//!   component; the prefix that already exists (the user's, as `/tmp`) is opened as it resolves.
//!   From that prefix's descriptor every component kvbm creates is made with `mkdirat` 0700 and
//!   opened with `openat(O_NOFOLLOW | O_DIRECTORY)` from its parent's descriptor and checked with
//!   `fstat` (owned by this user, no group or other bits), so a link or directory planted in its
//!   place is refused, never followed; the path must still name the directory reached (else a
//!   component was moved meanwhile: refused). Directories are opened `O_PATH` (no read
//!   permission needed), and an open's own error is reported as it is. The last
//!   component is opened `O_NOFOLLOW`: with [`CacheFileOptions::private_dir`] (kvbm's default
//!   directory in the shared temporary directory) it must be a real directory of this user with
//!   no group or other bits; a directory the user named may be a link only when the link itself
//!   belongs to this user or root, and must then pass the sticky/ownership check above.
//! - The file's neighbours (the checkpoint and its temporary file) are opened, renamed and
//!   removed relative to the checked directory's descriptor, never by path; the checkpoint is
//!   read `O_NOFOLLOW | O_NONBLOCK` and must be a regular file of this user (a FIFO planted in
//!   its place is ignored, never waited on).
//! - The file is preallocated with `fallocate`; where the file system refuses it, the file is sized
//!   with `set_len` instead (sparse), with one warning.
//! - O_DIRECT unless disabled; when the file system refuses it (EINVAL), the file is opened
//!   buffered with one warning, and [`CacheFile::io_mode`] says so.

use std::fs::{File, Permissions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
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
    /// The directory must be private to this user (kvbm's default one, in the shared temporary
    /// directory): not a symbolic link, owned by this user, no group or other mode bits.
    pub private_dir: bool,
}

impl Default for CacheFileOptions {
    fn default() -> Self {
        Self {
            disable_o_direct: false,
            lock_wait: LOCK_WAIT_DEFAULT,
            private_dir: false,
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

fn invalid_dir(dir: &Path, why: String) -> DiskError {
    DiskError::Invalid(format!(
        "cache directory {}: {why}; refusing to use it",
        dir.display()
    ))
}

fn dir_error(dir: &Path, source: std::io::Error) -> DiskError {
    DiskError::Directory {
        path: dir.to_owned(),
        source,
    }
}

/// Wraps a descriptor `open`/`openat` just returned.
fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: the caller passes a descriptor a successful `open`/`openat` just returned, owned by
    // nobody else.
    #[allow(unsafe_code)]
    unsafe {
        OwnedFd::from_raw_fd(fd)
    }
}

/// Flags of a directory opened only to look at it (`fstat`) and to open, create and rename
/// names in it (`*at`): `O_PATH` needs no read permission on it (a 0300 directory will do).
fn dir_flags(follow: bool) -> nix::fcntl::OFlag {
    use nix::fcntl::OFlag;
    let mut flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    if !follow {
        // With O_DIRECTORY, a link is refused (ENOTDIR) rather than opened itself.
        flags |= OFlag::O_NOFOLLOW;
    }
    flags
}

/// Opens `dir` as a directory, following a link on its last component only with `follow`.
fn open_dir(dir: &Path, follow: bool) -> std::io::Result<OwnedFd> {
    let fd = nix::fcntl::open(dir, dir_flags(follow), nix::sys::stat::Mode::empty())?;
    Ok(owned(fd))
}

/// Opens the directory `name` in the directory `parent`, never following a link.
fn open_dir_at(parent: &OwnedFd, name: &std::ffi::OsStr) -> std::io::Result<OwnedFd> {
    let fd = nix::fcntl::openat(
        Some(parent.as_raw_fd()),
        name,
        dir_flags(false),
        nix::sys::stat::Mode::empty(),
    )?;
    Ok(owned(fd))
}

/// Checks an open directory: with `private`, owned by this user with no group or other mode
/// bits; else owned by this user or root, and not writable by group or others unless the sticky
/// bit keeps them from touching our files (as in `/tmp`).
fn check_dir_fd(fd: &OwnedFd, dir: &Path, private: bool) -> Result<(), DiskError> {
    let meta = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| dir_error(dir, e.into()))?;
    let euid = nix::unistd::geteuid().as_raw();
    let mode = meta.st_mode & 0o7777;
    if private {
        if meta.st_uid != euid {
            return Err(invalid_dir(
                dir,
                format!(
                    "owned by uid {}, not this user (uid {euid}); kvbm's own directory must be \
                     private",
                    meta.st_uid
                ),
            ));
        }
        if mode & 0o077 != 0 {
            return Err(invalid_dir(
                dir,
                format!(
                    "mode {mode:o} gives group or others access; kvbm's own directory must be \
                     0700"
                ),
            ));
        }
        return Ok(());
    }
    if meta.st_uid != euid && meta.st_uid != 0 {
        return Err(invalid_dir(
            dir,
            format!(
                "owned by uid {}, not this user (uid {euid}) or root, who could replace the \
                 cache file",
                meta.st_uid
            ),
        ));
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(invalid_dir(
            dir,
            format!(
                "mode {mode:o} lets other users replace the cache file; use a directory only \
                 this user can write to (kvbm creates its own 0700)"
            ),
        ));
    }
    Ok(())
}

/// Opens the existing directory `dir` and checks it (see the module's invariants): a link on
/// its last component is refused when `private`, else followed only when the link belongs to
/// this user or root.
fn open_checked_dir(dir: &Path, private: bool) -> Result<OwnedFd, DiskError> {
    use std::os::unix::fs::MetadataExt;
    let fd = match open_dir(dir, false) {
        Ok(fd) => fd,
        Err(e) => {
            let Ok(link) = std::fs::symlink_metadata(dir) else {
                return Err(dir_error(dir, e));
            };
            if !link.file_type().is_symlink() {
                // Not a link: the open's own error (EACCES, EMFILE, ENOTDIR, ...).
                return Err(dir_error(dir, e));
            }
            let target = std::fs::read_link(dir).unwrap_or_default();
            let euid = nix::unistd::geteuid().as_raw();
            if private {
                return Err(invalid_dir(
                    dir,
                    format!(
                        "is a symbolic link (to {}); kvbm's own directory must be a directory \
                         of this user, never a link",
                        target.display()
                    ),
                ));
            }
            if link.uid() != euid && link.uid() != 0 {
                return Err(invalid_dir(
                    dir,
                    format!(
                        "is a symbolic link (to {}) owned by uid {}, not this user (uid {euid}) \
                         or root",
                        target.display(),
                        link.uid()
                    ),
                ));
            }
            open_dir(dir, true).map_err(|e| dir_error(dir, e))?
        }
    };
    check_dir_fd(&fd, dir, private)?;
    Ok(fd)
}

/// Opens the cache directory `dir`, creating the components that do not exist yet, and checks
/// it (see the module's invariants). The existing prefix of `dir` (the user's, as `/tmp`) is
/// opened as it resolves; from there every component kvbm creates is made with `mkdirat` 0700
/// in its parent's descriptor and opened with `openat(O_NOFOLLOW | O_DIRECTORY)` from it, so
/// that no link is followed on any component kvbm creates, nor on the last component. A
/// component that appears meanwhile must pass the checks of an existing one (private unless it
/// is the last one and not `private`).
fn open_cache_dir(dir: &Path, private: bool) -> Result<OwnedFd, DiskError> {
    open_cache_dir_hooked(dir, private, |_| {})
}

/// [`open_cache_dir`], calling `before_create` with each component's path before creating it
/// (for tests that plant something meanwhile).
fn open_cache_dir_hooked(
    dir: &Path,
    private: bool,
    mut before_create: impl FnMut(&Path),
) -> Result<OwnedFd, DiskError> {
    let mut missing = Vec::new();
    let mut at = dir;
    let base = loop {
        match std::fs::symlink_metadata(at) {
            Ok(_) => break Some(at),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                missing.push(at);
                match at.parent() {
                    Some(parent) if !parent.as_os_str().is_empty() => at = parent,
                    _ => break None,
                }
            }
            Err(e) => return Err(dir_error(at, e)),
        }
    };
    if missing.is_empty() {
        return open_checked_dir(dir, private);
    }
    // The existing prefix: the current directory for a relative path none of which exists.
    let base_path = base.unwrap_or(Path::new("."));
    let mut parent = open_dir(base_path, true).map_err(|e| dir_error(base_path, e))?;
    for component in missing.into_iter().rev() {
        let last = component == dir;
        let name = component
            .file_name()
            .ok_or_else(|| invalid_dir(component, "does not end in a plain name".to_owned()))?;
        before_create(component);
        match nix::sys::stat::mkdirat(
            Some(parent.as_raw_fd()),
            name,
            nix::sys::stat::Mode::from_bits_truncate(CACHE_DIR_MODE),
        ) {
            Ok(()) => {
                let fd = open_dir_at(&parent, name).map_err(|e| {
                    invalid_dir(
                        component,
                        format!("replaced right after kvbm created it ({e})"),
                    )
                })?;
                check_dir_fd(&fd, component, true)?;
                parent = fd;
            }
            Err(nix::errno::Errno::EEXIST) => {
                let fd = open_dir_at(&parent, name).map_err(|e| {
                    if e.raw_os_error() == Some(libc::ENOTDIR) {
                        invalid_dir(
                            component,
                            "appeared meanwhile as something else than a directory (a link?)"
                                .to_owned(),
                        )
                    } else {
                        dir_error(component, e)
                    }
                })?;
                check_dir_fd(&fd, component, private || !last)?;
                parent = fd;
            }
            Err(errno) => return Err(dir_error(component, errno.into())),
        }
    }
    // The path must still name the directory reached through the descriptors: a component
    // moved or replaced meanwhile would leave the file somewhere the path does not say.
    let id = |fd: &OwnedFd| {
        nix::sys::stat::fstat(fd.as_raw_fd())
            .ok()
            .map(|m| (m.st_dev, m.st_ino))
    };
    let by_path = open_dir(dir, false).ok().and_then(|fd| id(&fd));
    if by_path.is_none() || by_path != id(&parent) {
        return Err(invalid_dir(
            dir,
            "a component was moved or replaced while kvbm created it".to_owned(),
        ));
    }
    Ok(parent)
}

/// An open, locked, sized cache file.
#[derive(Debug)]
pub struct CacheFile {
    file: Flock<File>,
    /// The checked directory the file is in: its neighbours (the checkpoint) are opened,
    /// renamed and removed relative to it, never by path.
    dir: OwnedFd,
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

/// Opens `name` in the directory `dir` (its path `path`, for messages), created 0600 when
/// `write`, without following a link, with O_DIRECT unless refused or disabled, and checks it
/// is a private file of this user.
fn open_private(
    dir: &OwnedFd,
    name: &str,
    path: &Path,
    options: CacheFileOptions,
    write: bool,
) -> Result<(File, IoMode), DiskError> {
    use nix::fcntl::OFlag;
    let open = |direct: bool| -> std::io::Result<File> {
        let mut flags = OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        if direct {
            flags |= OFlag::O_DIRECT;
        }
        flags |= if write {
            OFlag::O_RDWR | OFlag::O_CREAT
        } else {
            OFlag::O_RDONLY
        };
        let fd = nix::fcntl::openat(
            Some(dir.as_raw_fd()),
            name,
            flags,
            nix::sys::stat::Mode::from_bits_truncate(CACHE_FILE_MODE),
        )?;
        // SAFETY: `openat` just returned this descriptor, owned by nobody else.
        #[allow(unsafe_code)]
        Ok(unsafe { File::from_raw_fd(fd) })
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
        let dir_fd = open_cache_dir(dir, options.private_dir)?;
        nix::unistd::faccessat(
            Some(dir_fd.as_raw_fd()),
            ".",
            nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK,
            nix::fcntl::AtFlags::empty(),
        )
        .map_err(|errno| dir_error(dir, errno.into()))?;

        let path = dir.join(name);
        let file_error = |call, source| DiskError::File {
            path: path.clone(),
            call,
            source,
        };
        let (file, mode) = open_private(&dir_fd, name, &path, options, true)?;
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
            dir: dir_fd,
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
        let dir_fd = open_checked_dir(dir, options.private_dir)?;
        let path = dir.join(name);
        let file_error = |call, source| DiskError::File {
            path: path.clone(),
            call,
            source,
        };
        let (file, mode) = open_private(&dir_fd, name, &path, options, false)?;
        let file = lock_waiting(file, FlockArg::LockSharedNonblock, options.lock_wait, &path)?;
        let len = file.metadata().map_err(|e| file_error("fstat", e))?.len();
        Ok(Self {
            file,
            dir: dir_fd,
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

    /// The checked directory the file is in.
    pub(crate) fn dir_fd(&self) -> RawFd {
        self.dir.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_planted_on_a_component_kvbm_created_is_never_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let a = tmp.path().join("a");
        let dir = a.join("b").join("c");
        // Once kvbm has created `a`, it is moved aside and a link to `elsewhere` takes its name
        // before `a/b` is created.
        let result = open_cache_dir_hooked(&dir, false, |component| {
            if component == a.join("b") {
                std::fs::rename(&a, tmp.path().join("moved")).unwrap();
                std::os::unix::fs::symlink(&elsewhere, &a).unwrap();
            }
        });
        match result {
            Err(DiskError::Invalid(m)) => assert!(m.contains("moved or replaced"), "{m}"),
            other => panic!("expected the swapped path refused, got {other:?}"),
        }
        assert!(
            std::fs::read_dir(&elsewhere).unwrap().next().is_none(),
            "nothing was created through the link"
        );
        // A link planted where kvbm is about to create a component is refused, not followed.
        let dir = tmp.path().join("x").join("y");
        let result = open_cache_dir_hooked(&dir, false, |component| {
            if component == dir {
                std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();
            }
        });
        assert!(matches!(result, Err(DiskError::Invalid(_))), "{result:?}");
        let result = open_cache_dir_hooked(&tmp.path().join("p").join("q"), false, |c| {
            if c == tmp.path().join("p") {
                std::os::unix::fs::symlink(&elsewhere, c).unwrap();
            }
        });
        assert!(matches!(result, Err(DiskError::Invalid(_))), "{result:?}");
        assert!(std::fs::read_dir(&elsewhere).unwrap().next().is_none());
    }

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
