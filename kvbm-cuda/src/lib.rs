//! kvbm-cuda: the device layer. Moves bytes between addresses; knows nothing of KV blocks.
//!
//! Owns: GPU memory regions (allocated here or registered from an engine), pinned host regions
//! (pinned in the background, usable as they become ready), copy streams and their completions.
//! Two back ends behind one API, chosen at run time: CUDA (cudarc, the driver loaded dynamically)
//! and an emulated device whose "GPU memory" is ordinary host memory and whose streams are worker
//! threads doing memcpy.
//!
//! Invariants:
//! - No CUDA function is called before `is_culib_present()` said the driver library exists, and
//!   none that the installed driver lacks (batched copies are gated on the driver version).
//! - A copy stream keeps every region of a transfer alive until the transfer's completion has been
//!   observed by the stream itself; dropping a [`Completion`] only withdraws interest.
//! - Every piece of a transfer lies inside a region handed in with it, and every host byte it
//!   touches is inside that region's ready (pinned) prefix; otherwise the submit is refused.
//! - `unsafe` lives in this crate and kvbm-disk only; each block says why it is sound.

mod cuda;
mod device;
mod emulated;
mod error;
mod host;
mod mapping;
mod region;
mod stream;

pub use device::{BackendChoice, Device, DeviceKind, BACKEND_ENV};
pub use emulated::StreamHold;
pub use error::DeviceError;
pub use host::{HostRegion, HostRegionOptions, PinStatus, PIN_CHUNK_BYTES_MAX};
pub use region::{GpuRegion, Region};
pub use stream::{
    coalesce, Completion, CopyPiece, CopyStream, Direction, StreamOptions, StreamStats, Transfer,
    BATCH_COPY_ENV, COALESCE_ENV, STREAM_QUEUE_MAX,
};
