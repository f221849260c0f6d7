//! Growable arrays of plain values in anonymous mappings advised for transparent huge pages.
//!
//! The index's arena and table are tens of megabytes read at random; with 4 KiB pages nearly
//! every probe also misses the TLB. Heap allocations get huge pages only where the system turns
//! them on for everything, so these arrays map their own memory and ask for them
//! (`MADV_HUGEPAGE`, a hint: without it they still work, just slower). Fresh mappings are zeroed,
//! which the table uses as "vacant". On Linux an array grows with `mremap`, which moves page tables
//! instead of copying.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use bytemuck::Pod;
use memmap2::{Advice, MmapMut};

/// Starts loading the cache line of `value` (a hint: it never faults and changes nothing).
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unused_unsafe)]
    // SAFETY: a prefetch is a hint that never faults; the pointer comes from a reference anyway.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// Mappings of at least this size are advised for huge pages.
const HUGE_PAGE: usize = 2 << 20;

pub(crate) struct MappedVec<T> {
    map: Option<MmapMut>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T> std::fmt::Debug for MappedVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedVec")
            .field("len", &self.len)
            .field("mapped_bytes", &self.map.as_ref().map_or(0, |m| m.len()))
            .finish()
    }
}

impl<T: Pod> MappedVec<T> {
    pub(crate) fn new() -> Self {
        Self {
            map: None,
            len: 0,
            _values: PhantomData,
        }
    }

    /// Empty, with room for `capacity` values mapped (their pages are touched only when used).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            map: Self::map(capacity),
            len: 0,
            _values: PhantomData,
        }
    }

    /// `len` zeroed values.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self {
            map: Self::map(len),
            len,
            _values: PhantomData,
        }
    }

    fn map(values: usize) -> Option<MmapMut> {
        if values == 0 || std::mem::size_of::<T>() == 0 {
            return None;
        }
        let bytes = values * std::mem::size_of::<T>();
        // Like `Vec`, running out of address space is not recoverable here.
        let map = MmapMut::map_anon(bytes)
            .unwrap_or_else(|e| panic!("mapping {bytes} bytes for the router index: {e}"));
        if bytes >= HUGE_PAGE {
            // A hint only; kernels without transparent huge pages refuse it, which is fine.
            let _ = map.advise(Advice::HugePage);
        }
        Some(map)
    }

    pub(crate) fn capacity(&self) -> usize {
        self.map
            .as_ref()
            .map_or(0, |m| m.len() / std::mem::size_of::<T>().max(1))
    }

    /// Bytes mapped (the memory this array costs).
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.map.as_ref().map_or(0, |m| m.len())
    }

    fn resize_capacity(&mut self, capacity: usize) {
        #[cfg(target_os = "linux")]
        if let Some(map) = self.map.as_mut() {
            let bytes = capacity * std::mem::size_of::<T>();
            // SAFETY: `remap` may move the mapping; nothing points into it (slices of it borrow
            // `self`, which is borrowed mutably here), and the `stable_deref_trait` feature that
            // would promise a fixed address is not enabled.
            let moved = unsafe { map.remap(bytes, memmap2::RemapOptions::new().may_move(true)) };
            if moved.is_ok() {
                if bytes >= HUGE_PAGE {
                    let _ = map.advise(Advice::HugePage);
                }
                return;
            }
            // Otherwise (`bytes` is 0, or the kernel refused): copy into a new mapping.
        }
        let mut map = Self::map(capacity);
        if let (Some(new), Some(old)) = (map.as_mut(), self.map.as_ref()) {
            let bytes = self.len * std::mem::size_of::<T>();
            new[..bytes].copy_from_slice(&old[..bytes]);
        }
        self.map = map;
    }

    #[inline]
    pub(crate) fn push(&mut self, value: T) {
        if self.len == self.capacity() {
            let grown = (self.capacity() * 2).max(4096 / std::mem::size_of::<T>().max(1));
            self.resize_capacity(grown);
        }
        self.len += 1;
        let last = self.len - 1;
        self[last] = value;
    }

    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Gives back the mapped memory beyond the values held (plus a quarter, to absorb growth).
    pub(crate) fn shrink(&mut self) {
        let keep = self.len + self.len / 4;
        if keep < self.capacity() / 2 {
            self.resize_capacity(keep);
        }
    }
}

impl<T: Pod> Deref for MappedVec<T> {
    type Target = [T];

    #[inline]
    fn deref(&self) -> &[T] {
        match &self.map {
            Some(m) => &bytemuck::cast_slice(&m[..])[..self.len],
            None => &[],
        }
    }
}

impl<T: Pod> DerefMut for MappedVec<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.map {
            Some(m) => &mut bytemuck::cast_slice_mut(&mut m[..])[..self.len],
            None => &mut [],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_shrinks_and_keeps_its_values() {
        let mut v: MappedVec<u64> = MappedVec::new();
        assert!(v.is_empty());
        for i in 0..100_000u64 {
            v.push(i * 3);
        }
        assert_eq!(v.len(), 100_000);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64 * 3));
        v.truncate(10);
        v.shrink();
        assert!(v.capacity() < 100);
        assert_eq!(&v[..], &[0, 3, 6, 9, 12, 15, 18, 21, 24, 27]);
        let z: MappedVec<u32> = MappedVec::zeroed(5000);
        assert!(z.iter().all(|&x| x == 0));
        assert_eq!(z.mapped_bytes(), 20_000);
    }
}
