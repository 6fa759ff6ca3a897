//! The core's errors, layered by where they come from, with the fields a caller may act on
//! (which side, which position, which value, which bound; which driver call and code). The
//! Python bindings map each to an exception in one place (`python/errors.rs`).

use std::fmt;

use thiserror::Error;

/// Which index array of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Host,
    Device,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Device => "device",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A transfer refused before any byte moved (or, for `Changed`, stopped where an index array
/// changed under it).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TransferError {
    #[error("{side} index {value} at position {position} is negative")]
    Negative {
        side: Side,
        position: usize,
        value: i64,
    },
    #[error("{side} index {value} at position {position} is out of range [0, {bound})")]
    OutOfRange {
        side: Side,
        position: usize,
        value: i64,
        bound: u64,
    },
    /// SGLang's kernels' text.
    #[error("Source and destination indices must have the same length")]
    LengthMismatch { host: usize, device: usize },
    /// SGLang's direct ops' text.
    #[error("Source indices size must be divisible by page size")]
    PartialPage { len: usize, page_size: usize },
    #[error("host layer {layer} is out of range [0, {layers})")]
    LayerOutOfRange { layer: i64, layers: usize },
    #[error(
        "device page starting at index {start} (position {position}) needs rows [{start}, \
         {end}) but the device pool has {rows} rows"
    )]
    PageOutsideDevice {
        start: u64,
        position: usize,
        end: u64,
        rows: u64,
    },
    #[error(
        "page {page}: {side} index {value} at position {position} does not start a page (page \
         size {page_size}); page-block copies move whole {side} pages"
    )]
    PageNotAligned {
        page: usize,
        side: Side,
        value: u64,
        position: usize,
        page_size: u64,
    },
    #[error(
        "page {page}: {side} index {value} at position {position} breaks the run \
         {start}..{end} (page-block copies move {page_size} consecutive rows per page)"
    )]
    PageRunBroken {
        page: usize,
        side: Side,
        value: i64,
        position: usize,
        start: u64,
        end: u64,
        page_size: u64,
    },
    #[error(
        "{side} index {value} at position {position} changed while the transfer ran (index \
         arrays must stay unchanged for the call); the transfer stopped part-way"
    )]
    Changed {
        side: Side,
        position: usize,
        value: i64,
    },
    /// Every other refusal (pointer counts, residency, device placement, ...).
    #[error("{0}")]
    Other(String),
}

/// A CUDA driver call that failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{call} failed: {name} (rc={code}): {text}")]
pub struct DriverError {
    /// The driver call (or step) that failed, e.g. `cuMemcpyBatchAsync`.
    pub call: String,
    pub code: i32,
    /// `CUDA_ERROR_...`
    pub name: String,
    pub text: String,
}

#[derive(Debug, Error)]
pub enum Error {
    /// A layout/backend/op combination the pool does not support (Python raises ValueError).
    #[error("{0}")]
    Unsupported(String),
    /// Bad transfer arguments; nothing was written (Python `TransferError`).
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// A bad argument that is not a transfer (Python ValueError).
    #[error("{0}")]
    Value(String),
    /// A page outside the pool (Python `PageIndexError`).
    #[error("{0}")]
    PageIndex(String),
    /// A layer id outside the pool (Python `LayerIndexError`).
    #[error("{0}")]
    LayerIndex(String),
    /// What SGLang refuses with an `assert` (Python AssertionError, raised explicitly).
    #[error("{0}")]
    Assertion(String),
    /// What a pool kind does not offer (Python NotImplementedError).
    #[error("{0}")]
    NotImplemented(String),
    /// Geometry whose byte size does not fit in 64 bits, or is otherwise malformed.
    #[error("{0}")]
    Geometry(String),
    /// mmap / madvise / mbind failures.
    #[error("{0}")]
    HostMemory(String),
    /// CUDA is not usable here (no driver library, no device, ...).
    #[error("{0}")]
    CudaUnavailable(String),
    /// A CUDA driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The CUDA path refused or failed for a reason of its own (a capturing stream, a bad
    /// device-resident index reported by the kernels, a wait that ran out, ...).
    #[error("{0}")]
    Cuda(String),
    /// Internal to the CUDA path (`cuda::try_execute`): the call would have to block (wait for
    /// the GPU, JIT the kernels, allocate or pin memory) and was asked not to; nothing was
    /// enqueued. The caller retries with the GIL released; it never reaches Python.
    #[error("the CUDA call would block")]
    WouldBlock,
}

impl Error {
    /// A transfer refusal with only a message (see [`TransferError::Other`]).
    pub fn transfer(message: impl Into<String>) -> Self {
        Self::Transfer(TransferError::Other(message.into()))
    }
}

pub type Result<T> = std::result::Result<T, Error>;
