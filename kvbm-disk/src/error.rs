//! kvbm-disk's error type, grouped by what the caller can do.

use std::path::PathBuf;

/// Why a disk operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    // --- Setup: the directory or file cannot be used. ---
    /// The cache directory cannot be created or written.
    #[error("cache directory {path}: {source}")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Another process (or another open in this one) holds the cache file's lock.
    #[error(
        "cache file {path} is locked by another process (or another open in this one); waited \
         {waited:?} for it to be released"
    )]
    Locked {
        /// The file.
        path: PathBuf,
        /// How long the lock was waited for.
        waited: std::time::Duration,
    },
    /// Opening, sizing or locking the cache file failed.
    #[error("cache file {path}: {call}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The call that failed.
        call: &'static str,
        /// What the OS said.
        source: std::io::Error,
    },

    // --- The caller passed something wrong. ---
    /// An offset, length or address not aligned to 4 KiB, or a request outside the file.
    #[error("invalid request: {0}")]
    Invalid(String),

    // --- I/O failed; the block is not stored (or not read). ---
    /// The kernel reported an error for one operation.
    #[error("{op} of {len} bytes at offset {offset}: {source}")]
    Io {
        /// "read" or "write".
        op: &'static str,
        /// File offset.
        offset: u64,
        /// Bytes asked for.
        len: usize,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// An operation moved fewer bytes than asked.
    #[error("{op} at offset {offset} moved {done} of {len} bytes")]
    Short {
        /// "read" or "write".
        op: &'static str,
        /// File offset.
        offset: u64,
        /// Bytes asked for.
        len: usize,
        /// Bytes moved.
        done: usize,
    },
    /// The engine's thread has stopped.
    #[error("the I/O engine has stopped")]
    EngineStopped,
}

impl DiskError {
    /// True for ENOSPC, EDQUOT and EFBIG: the disk (or a limit) is full.
    pub fn is_no_space(&self) -> bool {
        match self {
            DiskError::Io { source, .. } | DiskError::File { source, .. } => matches!(
                source.raw_os_error(),
                Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG)
            ),
            _ => false,
        }
    }
}
