//! Choosing a back end and handing out regions and streams.

use std::str::FromStr;
use std::sync::Arc;

use crate::cuda::CudaBackend;
use crate::host::{HostRegion, HostRegionOptions};
use crate::region::GpuRegion;
use crate::stream::{CopyStream, Direction, StreamOptions};
use crate::DeviceError;

/// Environment variable that forces a back end: `auto` (default), `cuda` or `emulated`.
pub const BACKEND_ENV: &str = "KVBM_DEVICE";

/// Which back end to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// CUDA when a driver and a GPU are present, else the emulated device.
    #[default]
    Auto,
    /// CUDA or an error.
    Cuda,
    /// The emulated device, even where a GPU exists.
    Emulated,
}

impl FromStr for BackendChoice {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendChoice::Auto),
            "cuda" | "gpu" => Ok(BackendChoice::Cuda),
            "emulated" | "emulation" | "cpu" => Ok(BackendChoice::Emulated),
            _ => Err(DeviceError::InvalidArgument(format!(
                "{BACKEND_ENV}={s:?}: expected auto, cuda or emulated"
            ))),
        }
    }
}

impl BackendChoice {
    /// Reads [`BACKEND_ENV`]; unset means `Auto`.
    pub fn from_env() -> Result<Self, DeviceError> {
        match std::env::var(BACKEND_ENV) {
            Ok(v) => v.parse(),
            Err(std::env::VarError::NotPresent) => Ok(BackendChoice::Auto),
            Err(std::env::VarError::NotUnicode(v)) => Err(DeviceError::InvalidArgument(format!(
                "{BACKEND_ENV}={v:?}: not valid UTF-8"
            ))),
        }
    }
}

/// The back end a [`Device`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A real GPU through the CUDA driver.
    Cuda,
    /// Host memory and memcpy threads standing in for a GPU.
    Emulated,
}

impl DeviceKind {
    /// "cuda" or "emulated".
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cuda => "cuda",
            DeviceKind::Emulated => "emulated",
        }
    }
}

/// One GPU (or its emulation). Cheap to clone.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    ordinal: usize,
    cuda: Option<CudaBackend>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("kind", &self.kind())
            .field("description", &self.description())
            .finish()
    }
}

impl Device {
    /// Opens GPU `ordinal` on the chosen back end. `Auto` falls back to the emulated device
    /// (with one log line saying why) when no driver or no such GPU exists.
    pub fn open(choice: BackendChoice, ordinal: usize) -> Result<Device, DeviceError> {
        let cuda = match choice {
            BackendChoice::Emulated => None,
            BackendChoice::Cuda => Some(CudaBackend::open(ordinal)?),
            BackendChoice::Auto => match CudaBackend::open(ordinal) {
                Ok(backend) => Some(backend),
                Err(err) => {
                    tracing::info!(reason = %err, "no usable CUDA device; using the emulated device");
                    None
                }
            },
        };
        if let Some(backend) = &cuda {
            tracing::info!(device = %backend.description(), "using the CUDA back end");
        }
        Ok(Device {
            inner: Arc::new(DeviceInner { ordinal, cuda }),
        })
    }

    /// Opens GPU `ordinal` with the back end named by [`BACKEND_ENV`].
    pub fn from_env(ordinal: usize) -> Result<Device, DeviceError> {
        Self::open(BackendChoice::from_env()?, ordinal)
    }

    /// The emulated device.
    pub fn emulated() -> Device {
        Device {
            inner: Arc::new(DeviceInner {
                ordinal: 0,
                cuda: None,
            }),
        }
    }

    /// Which back end this device runs on.
    pub fn kind(&self) -> DeviceKind {
        if self.inner.cuda.is_some() {
            DeviceKind::Cuda
        } else {
            DeviceKind::Emulated
        }
    }

    /// GPU ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// A human-readable line: GPU name and driver version, or "emulated".
    pub fn description(&self) -> String {
        match &self.inner.cuda {
            Some(backend) => backend.description(),
            None => "emulated device (host memory, memcpy worker threads)".to_owned(),
        }
    }

    /// The driver version as CUDA encodes it (12080 = 12.8), if on CUDA.
    pub fn driver_version(&self) -> Option<i32> {
        self.inner.cuda.as_ref().map(|b| b.driver_version())
    }

    /// Allocates `len_bytes` of GPU memory, owned by the returned region.
    pub fn alloc_gpu(&self, len_bytes: usize) -> Result<GpuRegion, DeviceError> {
        if len_bytes == 0 {
            return Err(DeviceError::InvalidArgument("GPU region of 0 bytes".into()));
        }
        match &self.inner.cuda {
            Some(backend) => backend.alloc(len_bytes),
            None => GpuRegion::emulated(len_bytes),
        }
    }

    /// Wraps GPU memory the engine owns (for example one of vLLM's KV cache tensors) without
    /// taking ownership: dropping the region frees nothing.
    ///
    /// # Safety
    /// `[addr, addr + len_bytes)` must be memory of this device (on the emulated device: readable
    /// and writable host memory) that stays valid for as long as the returned region or any
    /// transfer that holds it is alive.
    pub unsafe fn register_gpu(
        &self,
        addr: u64,
        len_bytes: usize,
        ordinal: usize,
    ) -> Result<GpuRegion, DeviceError> {
        if addr == 0 || len_bytes == 0 {
            return Err(DeviceError::InvalidArgument(format!(
                "external GPU region at {addr:#x} of {len_bytes} bytes"
            )));
        }
        if ordinal != self.inner.ordinal {
            return Err(DeviceError::InvalidArgument(format!(
                "memory of GPU {ordinal} registered with device {}",
                self.inner.ordinal
            )));
        }
        Ok(GpuRegion::external(
            addr,
            len_bytes,
            self.inner.cuda.as_ref().map(|b| b.context()),
        ))
    }

    /// Maps `len_bytes` of host memory and starts pinning it in the background (registered with
    /// the driver on CUDA, `mlock`ed on the emulated device). Usable up to `ready_bytes()`.
    pub fn alloc_host(
        &self,
        len_bytes: usize,
        options: HostRegionOptions,
    ) -> Result<HostRegion, DeviceError> {
        HostRegion::new(
            len_bytes,
            options,
            self.inner.cuda.as_ref().map(|b| b.context()),
        )
    }

    /// A copy stream for one direction with options from the environment.
    pub fn copy_stream(&self, direction: Direction) -> Result<CopyStream, DeviceError> {
        self.copy_stream_with(direction, StreamOptions::from_env()?)
    }

    /// A copy stream for one direction with explicit options.
    pub fn copy_stream_with(
        &self,
        direction: Direction,
        options: StreamOptions,
    ) -> Result<CopyStream, DeviceError> {
        match &self.inner.cuda {
            Some(backend) => CopyStream::cuda(backend, direction, options),
            None => CopyStream::emulated(direction, options),
        }
    }
}
