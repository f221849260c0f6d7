//! The device layer's error type: one enum, variants grouped by what the caller can do.

/// Why a device operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    // --- The machine cannot do this: choose another back end or give up. ---
    /// The CUDA back end was requested but no CUDA driver library could be loaded.
    #[error("the CUDA back end was requested but no CUDA driver (libcuda) is installed")]
    NoDriver,
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {code}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error code, as named by the driver.
        code: String,
    },
    /// An operating-system call failed (mmap, mlock, thread spawn).
    #[error("{call} failed: {errno}")]
    Os {
        /// The system call.
        call: &'static str,
        /// The error it returned.
        errno: nix::errno::Errno,
    },

    // --- The caller passed something wrong: a bug above this layer. ---
    /// A bad argument (a zero size, an unknown back end name, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A copy piece reaches outside the regions handed in with its transfer.
    #[error("copy piece {index} ({src:#x} -> {dst:#x}, {len} bytes) is not inside the transfer's {side} regions")]
    OutOfBounds {
        /// Position of the piece in the transfer.
        index: usize,
        /// Source address.
        src: u64,
        /// Target address.
        dst: u64,
        /// Length in bytes.
        len: usize,
        /// "source" or "target".
        side: &'static str,
    },

    // --- Transient: try again later. ---
    /// A host piece touches bytes that are not pinned yet.
    #[error("copy piece {index} touches host bytes past the ready prefix ({ready_bytes} bytes pinned so far)")]
    NotReady {
        /// Position of the piece in the transfer.
        index: usize,
        /// Bytes of the region pinned so far.
        ready_bytes: usize,
    },

    // --- The stream is gone. ---
    /// The copy stream's worker has stopped; no transfer can be submitted.
    #[error("the copy stream is closed")]
    StreamClosed,
}

impl DeviceError {
    pub(crate) fn driver(call: &'static str, err: cudarc::driver::DriverError) -> Self {
        DeviceError::Driver {
            call,
            code: format!("{:?}", err.0),
        }
    }
}
