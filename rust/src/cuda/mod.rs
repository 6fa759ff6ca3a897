//! CUDA path (driver probe, pinned registration, PTX launches, batched direct copies, kernel
//! emulation). PLACEHOLDER signatures owned by the CUDA work (issue 5): every function here is the
//! interface the rest of the crate calls; bodies are filled in by that work.

use crate::error::{Error, Result};
use crate::transfer::TransferRequest;

/// True when libcuda can be loaded and a device answers. Never panics.
pub fn available() -> bool {
    false
}

/// Human-readable reason why CUDA is or is not usable (driver version, device, library path).
pub fn runtime_info() -> String {
    "CUDA support not built yet".to_string()
}

/// Enqueue `req` on the raw CUDA stream `stream` (torch's current stream). No synchronisation.
pub fn execute(_req: &TransferRequest, _stream: u64) -> Result<()> {
    Err(Error::CudaUnavailable("CUDA support not built yet".into()))
}

/// Run the kernel backend's `.cu` code under the CPU emulation shim (device pointers are host
/// pointers). Used by tests to check the real kernel code without a GPU.
pub fn emulate(_req: &TransferRequest) -> Result<()> {
    Err(Error::Unsupported("kernel emulation not built yet".into()))
}

/// Register `[ptr, ptr+len)` with cuMemHostRegister(PORTABLE|DEVICEMAP) in chunks that are whole
/// multiples of `granularity` (0 = one registration) and at most `chunk_limit` bytes. Returns the
/// registered ranges; on failure rolls back and returns an error carrying the contract's text.
pub fn register_host(_ptr: u64, _len: usize, _granularity: usize, _chunk_limit: usize) -> Result<Vec<(u64, usize)>> {
    Err(Error::CudaUnavailable("CUDA support not built yet".into()))
}

/// Unregister ranges returned by `register_host` (reverse order, errors ignored).
pub fn unregister_host(_ranges: &[(u64, usize)]) {}

/// Report (and clear) a bad device-resident index recorded by a kernel since the last check.
pub fn check_device_errors() -> Result<()> {
    Ok(())
}
