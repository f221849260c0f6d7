//! "Device memory" (host memory from the global allocator) and registered host ranges, and the
//! classification of every address range a copy touches.
//!
//! Invariants:
//! - Device allocations are 256-byte aligned (as `cuMemAlloc`'s) and filled with [`POISON`]
//!   when allocated, so a read of bytes nobody wrote shows up as wrong bytes, not zeros.
//! - Registered host ranges never overlap each other.
//! - The device bytes in use never exceed the configured device memory size.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::config::config;
use crate::result::*;

/// Alignment of device allocations, as the real driver guarantees at least.
pub const DEVICE_ALIGN: usize = 256;
/// The byte fresh device memory holds.
pub const POISON: u8 = 0xA5;

#[derive(Default)]
struct Ranges {
    /// Start -> length of live device allocations.
    device: BTreeMap<u64, usize>,
    /// Start -> length of registered host ranges.
    host: BTreeMap<u64, usize>,
    device_bytes: u64,
}

static RANGES: Mutex<Ranges> = Mutex::new(Ranges {
    device: BTreeMap::new(),
    host: BTreeMap::new(),
    device_bytes: 0,
});

fn ranges() -> std::sync::MutexGuard<'static, Ranges> {
    RANGES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where a range `[addr, addr + len)` lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Inside one live device allocation.
    Device,
    /// Inside one registered (pinned) host range.
    Registered,
    /// Starts inside a device allocation or registered range and runs past its end.
    Straddles {
        /// Start of the allocation or range.
        start: u64,
        /// Its length.
        len: usize,
    },
    /// Nowhere the driver knows: pageable host memory.
    Pageable,
}

/// Which of `map`'s ranges holds `addr`, if any: (start, len).
fn holder(map: &BTreeMap<u64, usize>, addr: u64) -> Option<(u64, usize)> {
    let (&start, &len) = map.range(..=addr).next_back()?;
    (addr < start + len as u64).then_some((start, len))
}

/// Classifies `[addr, addr + len)`; a zero-length range is classified by its first byte.
pub fn place(addr: u64, len: usize) -> Place {
    let ranges = ranges();
    let end = addr.saturating_add(len as u64);
    for (map, inside) in [
        (&ranges.device, Place::Device),
        (&ranges.host, Place::Registered),
    ] {
        if let Some((start, range_len)) = holder(map, addr) {
            return if end <= start + range_len as u64 {
                inside
            } else {
                Place::Straddles {
                    start,
                    len: range_len,
                }
            };
        }
    }
    Place::Pageable
}

/// Allocates `len` bytes of device memory.
pub(crate) fn alloc_device(len: usize) -> Result<u64, CUresult> {
    if len == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let layout =
        Layout::from_size_align(len, DEVICE_ALIGN).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    let mut ranges = ranges();
    if ranges.device_bytes + len as u64 > config().memory_bytes {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: the layout has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc(layout) };
    if ptr.is_null() {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: `ptr` is a fresh allocation of `len` bytes.
    unsafe { std::ptr::write_bytes(ptr, POISON, len) };
    ranges.device.insert(ptr as u64, len);
    ranges.device_bytes += len as u64;
    Ok(ptr as u64)
}

/// Length of the device allocation that starts at `addr`, if one does.
pub(crate) fn device_len(addr: u64) -> Option<usize> {
    ranges().device.get(&addr).copied()
}

/// Length of the registered host range that starts at `addr`, if one does.
pub(crate) fn host_len(addr: u64) -> Option<usize> {
    ranges().host.get(&addr).copied()
}

/// Takes a device allocation out of the table without returning its memory: a queued copy
/// still uses it, and freeing it would corrupt this process instead of reporting the misuse.
pub(crate) fn quarantine_device(addr: u64) {
    let mut ranges = ranges();
    if let Some(len) = ranges.device.remove(&addr) {
        ranges.device_bytes -= len as u64;
    }
}

/// Frees a device allocation by its start address.
pub(crate) fn free_device(addr: u64) -> Result<(), CUresult> {
    let mut ranges = ranges();
    let Some(len) = ranges.device.remove(&addr) else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    ranges.device_bytes -= len as u64;
    let layout = Layout::from_size_align(len, DEVICE_ALIGN).expect("the layout allocated with");
    // SAFETY: `addr` was returned by `alloc_device` with this layout and is freed once: it was
    // just removed from the table of live allocations.
    unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
    Ok(())
}

/// Registers `[addr, addr + len)` as pinned host memory.
pub(crate) fn register_host(addr: u64, len: usize) -> Result<(), CUresult> {
    if addr == 0 || len == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let end = addr
        .checked_add(len as u64)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut ranges = ranges();
    let overlaps =
        holder(&ranges.host, addr).is_some() || ranges.host.range(addr..end).next().is_some();
    if overlaps {
        return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    }
    if holder(&ranges.device, addr).is_some() || ranges.device.range(addr..end).next().is_some() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    ranges.host.insert(addr, len);
    Ok(())
}

/// Unregisters the host range that starts at `addr`.
pub(crate) fn unregister_host(addr: u64) -> Result<(), CUresult> {
    match ranges().host.remove(&addr) {
        Some(_) => Ok(()),
        None => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
    }
}

/// Device bytes in use.
pub fn device_bytes_in_use() -> u64 {
    ranges().device_bytes
}
