//! GPU regions and the [`Region`] enum that transfers hold on to.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::host::HostRegion;
use crate::mapping::Mapping;
use crate::DeviceError;

/// A range of GPU memory: allocated here (freed on the last drop) or registered from its owner.
/// Cheap to clone; clones share the memory.
#[derive(Clone)]
pub struct GpuRegion {
    inner: Arc<GpuInner>,
}

struct GpuInner {
    addr: u64,
    len: usize,
    /// The CUDA context of the memory; `None` on the emulated device.
    ctx: Option<Arc<CudaContext>>,
    backing: Backing,
}

enum Backing {
    /// Emulated "GPU memory": an anonymous mapping.
    Emulated(#[allow(dead_code)] Mapping),
    /// `cuMemAlloc`ed here; `cuMemFree`d on drop.
    CudaOwned,
    /// Owned by someone else (an engine's tensor).
    External,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRegion")
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .field("external", &self.is_external())
            .finish()
    }
}

impl GpuRegion {
    pub(crate) fn emulated(len: usize) -> Result<Self, DeviceError> {
        let mapping = Mapping::new(len)?;
        Ok(Self::from_inner(GpuInner {
            addr: mapping.addr(),
            len,
            ctx: None,
            backing: Backing::Emulated(mapping),
        }))
    }

    pub(crate) fn cuda_owned(addr: u64, len: usize, ctx: Arc<CudaContext>) -> Self {
        Self::from_inner(GpuInner {
            addr,
            len,
            ctx: Some(ctx),
            backing: Backing::CudaOwned,
        })
    }

    pub(crate) fn external(addr: u64, len: usize, ctx: Option<Arc<CudaContext>>) -> Self {
        Self::from_inner(GpuInner {
            addr,
            len,
            ctx,
            backing: Backing::External,
        })
    }

    fn from_inner(inner: GpuInner) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// True when the memory belongs to someone else.
    pub fn is_external(&self) -> bool {
        matches!(self.inner.backing, Backing::External)
    }

    /// Copies `bytes` into the region at `offset`, synchronously. For filling and checking blocks
    /// in tests and benchmarks; racing with an in-flight transfer on the same bytes leaves them
    /// unspecified, exactly as a DMA engine would.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), DeviceError> {
        self.check_range(offset, bytes.len())?;
        let dst = self.inner.addr + offset as u64;
        match &self.inner.ctx {
            None => {
                // SAFETY: the range was checked to lie inside this live host-backed region, and
                // `bytes` is a distinct Rust slice, so the ranges do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, bytes.len())
                };
                Ok(())
            }
            Some(ctx) => {
                ctx.bind_to_thread()
                    .map_err(|e| DeviceError::driver("cuCtxSetCurrent", e))?;
                // SAFETY: the range lies inside this live device allocation; the copy is
                // synchronous, so `bytes` outlives it.
                unsafe { result::memcpy_htod_sync(dst, bytes) }
                    .map_err(|e| DeviceError::driver("cuMemcpyHtoD", e))
            }
        }
    }

    /// Copies bytes out of the region at `offset` into `out`, synchronously (see [`Self::write`]).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check_range(offset, out.len())?;
        let src = self.inner.addr + offset as u64;
        match &self.inner.ctx {
            None => {
                // SAFETY: the range was checked to lie inside this live host-backed region, and
                // `out` is a distinct Rust slice.
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), out.len())
                };
                Ok(())
            }
            Some(ctx) => {
                ctx.bind_to_thread()
                    .map_err(|e| DeviceError::driver("cuCtxSetCurrent", e))?;
                // SAFETY: the range lies inside this live device allocation; the copy is
                // synchronous, so `out` outlives it.
                unsafe { result::memcpy_dtoh_sync(out, src) }
                    .map_err(|e| DeviceError::driver("cuMemcpyDtoH", e))
            }
        }
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(DeviceError::InvalidArgument(format!(
                "range {offset}+{len} outside a GPU region of {} bytes",
                self.inner.len
            ))),
        }
    }
}

impl Drop for GpuInner {
    fn drop(&mut self) {
        if let (Backing::CudaOwned, Some(ctx)) = (&self.backing, &self.ctx) {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: the allocation came from cuMemAlloc in this context, and this is the
                // last reference: every transfer holding it has completed and released it.
                let _ = unsafe { sys::cuMemFree_v2(self.addr) };
            }
        }
    }
}

/// A region a transfer reads or writes. Holding one keeps the memory alive.
#[derive(Debug, Clone)]
pub enum Region {
    /// GPU memory.
    Gpu(GpuRegion),
    /// Pinned host memory.
    Host(HostRegion),
}

impl From<GpuRegion> for Region {
    fn from(r: GpuRegion) -> Self {
        Region::Gpu(r)
    }
}

impl From<HostRegion> for Region {
    fn from(r: HostRegion) -> Self {
        Region::Host(r)
    }
}

impl Region {
    /// First byte's address.
    pub fn addr(&self) -> u64 {
        match self {
            Region::Gpu(r) => r.addr(),
            Region::Host(r) => r.addr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Region::Gpu(r) => r.len(),
            Region::Host(r) => r.len(),
        }
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
