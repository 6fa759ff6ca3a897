//! One error type for the core; `python.rs` maps each variant to a Python exception in one place.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// A layout/backend/op combination the pool does not support (Python raises ValueError).
    #[error("{0}")]
    Unsupported(String),
    /// Bad transfer arguments: index out of range, negative, length mismatch, bad layer id.
    /// Raised before any byte moves.
    #[error("{0}")]
    InvalidTransfer(String),
    /// A bad argument that is not a transfer (Python ValueError).
    #[error("{0}")]
    Value(String),
    /// A page outside the pool (Python `PageIndexError`: a ValueError and an IndexError).
    #[error("{0}")]
    PageIndex(String),
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
    #[error("{0}")]
    Cuda(String),
    /// Internal to the CUDA path (`cuda::try_execute`): the call would have to block (wait for
    /// the GPU, JIT the kernels, allocate or pin memory) and was asked not to; nothing was
    /// enqueued. The caller retries with the GIL released; it never reaches Python.
    #[error("the CUDA call would block")]
    WouldBlock,
}

pub type Result<T> = std::result::Result<T, Error>;
