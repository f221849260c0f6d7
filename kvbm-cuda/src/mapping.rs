//! An anonymous private memory mapping, unmapped on drop. The only owner of raw host memory here.

use std::num::NonZeroUsize;
use std::ptr::NonNull;

use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};

use crate::DeviceError;

/// Size of a base page; regions and pin chunks are multiples of it.
pub(crate) const PAGE_BYTES: usize = 4096;

#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through raw pointers whose
// synchronisation is the callers' business (copy streams, block states), never through references.
unsafe impl Send for Mapping {}
// SAFETY: as above; `Mapping` itself holds no interior state beyond the pointer and length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (rounded up to whole pages), readable and writable, not yet faulted in.
    pub(crate) fn new(len: usize) -> Result<Self, DeviceError> {
        let len = round_up(len.max(1), PAGE_BYTES);
        let size = NonZeroUsize::new(len).expect("len is at least one page");
        // SAFETY: a fresh private anonymous mapping aliases nothing; we own it until `munmap`.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }
        .map_err(|errno| DeviceError::Os {
            call: "mmap",
            errno,
        })?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Asks for transparent huge pages; a refusal is harmless and ignored.
    pub(crate) fn advise_huge_pages(&self) {
        // SAFETY: the range is exactly this live mapping; madvise does not change its contents.
        let _ = unsafe {
            nix::sys::mman::madvise(
                self.ptr.cast(),
                self.len,
                nix::sys::mman::MmapAdvise::MADV_HUGEPAGE,
            )
        };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `mmap_anonymous` with this length, and every user
        // (regions, streams) holds an Arc to its owner, so nothing uses it after this point.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

pub(crate) fn round_up(value: usize, multiple: usize) -> usize {
    value.div_ceil(multiple) * multiple
}
