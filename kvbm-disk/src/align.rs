//! 4 KiB-aligned owned buffers, for O_DIRECT I/O of headers and for callers without pinned memory.

use std::num::NonZeroUsize;
use std::ptr::NonNull;

use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};

/// Alignment of every offset, length and buffer address given to the disk (O_DIRECT's).
pub const ALIGN_BYTES: usize = 4096;

/// An owned, zero-initialised, page-aligned buffer whose length is a multiple of 4 KiB.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; shared access is only through `&self`
// (reads) and exclusive access through `&mut self`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes (rounded up to 4 KiB), zeroed.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let len = len.max(1).div_ceil(ALIGN_BYTES) * ALIGN_BYTES;
        let size = NonZeroUsize::new(len).expect("at least one page");
        // SAFETY: a fresh private anonymous mapping aliases nothing; it is unmapped in Drop.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .map_err(std::io::Error::from)?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes (a multiple of 4 KiB).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: buffers have at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live, initialised (zeroed by the kernel) and `len` bytes long;
        // `&self` excludes writers through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping came from mmap_anonymous with this length; engines hold the buffer
        // (by ownership) until their I/O completed, so nothing uses it after this.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}
