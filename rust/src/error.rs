//! The core's errors, layered by where they come from, with the fields a caller may act on
//! (which side, which position, which value, which bound; which driver call and code; how many
//! bytes):
//! - [`LayoutError`]: a pool that cannot be built, or a (kind, layout, backend) it does not serve;
//! - [`PlanError`]: a transfer refused before a byte moved (its indices, lengths, layers);
//! - [`ArgError`]: any other refused argument, in SGLang's words and exception class;
//! - [`MemError`]: host memory the OS would not map, bind or fault in;
//! - [`CudaError`]: CUDA missing, a driver call failing, or the CUDA path refusing.
//!
//! Each converts into the one [`Error`] with `?`; the Python bindings map each to an exception in
//! one place (`python/errors.rs`).

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
pub enum PlanError {
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
    /// Token-granular (C4) indices: the caller's token numbers, not the rows they map to.
    #[error(
        "token-granular transfer: {side} token indices must lie in [0, {bound}), got min={min}, \
         max={max}"
    )]
    TokenOutOfRange {
        side: Side,
        min: i64,
        max: i64,
        bound: u64,
    },
    /// SGLang's kernels' text; with `pool` (a paged pool's name), its paged pools' text.
    #[error("{}", length_mismatch_text(pool.as_deref(), *host, *device))]
    LengthMismatch {
        host: usize,
        device: usize,
        pool: Option<String>,
    },
    /// SGLang's direct ops' text; with `pool` (a paged pool's name), its paged pools' text.
    #[error("{}", partial_page_text(pool.as_deref(), *len, *page_size))]
    PartialPage {
        len: usize,
        page_size: usize,
        pool: Option<String>,
    },
    #[error("host layer {layer} is out of range [0, {layers})")]
    LayerOutOfRange { layer: i64, layers: usize },
    /// A layer the call names that the device pool handed to it does not have.
    #[error("layer_id {layer} is out of range: the device pool has {layers} layers")]
    DeviceLayerOutOfRange { layer: i64, layers: usize },
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

/// A pool that cannot be built, or a combination it does not serve (Python ValueError).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LayoutError {
    /// The support table's refusal of a (kind, layout, io backend, transfer) cell, in SGLang's
    /// words.
    #[error("{0}")]
    Unsupported(String),
    /// Geometry that is malformed or whose byte size does not fit in 64 bits.
    #[error("{0}")]
    Geometry(String),
}

/// A refused argument that is neither geometry nor a transfer's indices, raised as the class
/// SGLang raises for it.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ArgError {
    /// Python ValueError.
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
    /// An object that cannot serve the call in its present state (used in a forked child with
    /// a lock the parent held, ...): Python RuntimeError.
    #[error("{0}")]
    State(String),
}

/// Host memory the OS refused (Python MemoryError).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MemError {
    #[error("cannot map {bytes} bytes: size overflows")]
    Overflow { bytes: u64 },
    #[error(
        "could not map {bytes} bytes on {tier} hugepages (MAP_HUGETLB): {os}; reserve hugepages \
         (vm.nr_hugepages) or use hugepage_mode='prefer'"
    )]
    Hugepages {
        bytes: u64,
        tier: &'static str,
        os: String,
    },
    #[error("could not map {bytes} bytes of host memory (mmap): {os}")]
    Map { bytes: u64, os: String },
    #[error("could not bind {bytes} bytes of host memory to NUMA node {node} (mbind): {os}")]
    Bind { bytes: u64, node: u32, os: String },
    #[error("could not pre-fault {bytes} bytes of host memory (MADV_POPULATE_WRITE): {os}")]
    Prefault { bytes: u64, os: String },
    #[error("pre-touch thread failed")]
    PretouchThread,
    #[error("madvise(MADV_DONTFORK): {os}")]
    DontFork { os: String },
}

/// The CUDA side (Python RuntimeError).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// CUDA is not usable here (no driver library, no device, a forked child, ...).
    #[error("{0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The CUDA path refused or failed for a reason of its own (a capturing stream, a bad
    /// device-resident index reported by the kernels, a wait that ran out, ...).
    #[error("{0}")]
    Refused(String),
    /// Internal to the CUDA path (`cuda::try_execute`): the call would have to block (wait for
    /// the GPU, JIT the kernels, allocate or pin memory) and was asked not to; nothing was
    /// enqueued. The caller retries with the GIL released; it never reaches Python.
    #[error("the CUDA call would block")]
    WouldBlock,
}

/// Every error of the core: one layer each.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum Error {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Arg(#[from] ArgError),
    #[error(transparent)]
    Mem(#[from] MemError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        Self::Cuda(CudaError::Driver(e))
    }
}

/// Shorthands for the text-only refusals, so call sites read as what they refuse.
impl Error {
    /// A transfer refusal with only a message (see [`PlanError::Other`]).
    pub fn transfer(message: impl Into<String>) -> Self {
        Self::Plan(PlanError::Other(message.into()))
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::Layout(LayoutError::Unsupported(message.into()))
    }
    pub fn geometry(message: impl Into<String>) -> Self {
        Self::Layout(LayoutError::Geometry(message.into()))
    }
    pub fn value(message: impl Into<String>) -> Self {
        Self::Arg(ArgError::Value(message.into()))
    }
    pub fn page_index(message: impl Into<String>) -> Self {
        Self::Arg(ArgError::PageIndex(message.into()))
    }
    pub fn layer_index(message: impl Into<String>) -> Self {
        Self::Arg(ArgError::LayerIndex(message.into()))
    }
    pub fn assertion(message: impl Into<String>) -> Self {
        Self::Arg(ArgError::Assertion(message.into()))
    }
    pub fn not_implemented(message: impl Into<String>) -> Self {
        Self::Arg(ArgError::NotImplemented(message.into()))
    }
    pub fn state(message: impl Into<String>) -> Self {
        Self::Arg(ArgError::State(message.into()))
    }
    pub fn cuda_unavailable(message: impl Into<String>) -> Self {
        Self::Cuda(CudaError::Unavailable(message.into()))
    }
    pub fn cuda(message: impl Into<String>) -> Self {
        Self::Cuda(CudaError::Refused(message.into()))
    }
    /// Whether this is the CUDA path's internal "would block" (never shown to Python).
    pub fn would_block(&self) -> bool {
        matches!(self, Self::Cuda(CudaError::WouldBlock))
    }
}

pub type Result<T> = std::result::Result<T, Error>;

fn length_mismatch_text(pool: Option<&str>, host: usize, device: usize) -> String {
    match pool {
        Some(name) => format!("{name} transfer index size mismatch: host={host}, device={device}"),
        None => "Source and destination indices must have the same length".to_owned(),
    }
}

/// `len` is both sides' count: a partial page is refused only after the lengths matched.
fn partial_page_text(pool: Option<&str>, len: usize, page_size: usize) -> String {
    match pool {
        Some(name) => format!(
            "{name} expects page-aligned indices: got {len} host and {len} device indices \
             for page size {page_size}."
        ),
        None => "Source indices size must be divisible by page size".to_owned(),
    }
}
