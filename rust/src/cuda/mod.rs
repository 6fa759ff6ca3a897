//! CUDA path: driver probe, pinned registration, PTX kernel launches, batched direct copies, and
//! the CPU emulation of the kernels. See docs/cuda.md.
//!
//! Nothing here touches CUDA until one of these functions is called, every driver call is
//! preceded by `is_culib_present` (cudarc panics instead of failing when libcuda is missing) and
//! runs under `catch_unwind`, so no panic can reach Python.

mod direct;
mod driver;
mod emulate;
mod errword;
mod launch;
mod module;
mod params;
mod probe;
mod ptx;
mod register;
mod staging;

#[cfg(test)]
mod tests;

use crate::error::Result;
use crate::plan::{self, Strategy};
use crate::transfer::TransferRequest;
use driver::guard;

/// True when libcuda can be loaded and a device answers. Never panics.
pub fn available() -> bool {
    probe::ready().is_ok()
}

/// Human-readable reason why CUDA is or is not usable (driver version, device, library path).
pub fn runtime_info() -> String {
    probe::describe(&probe::probe())
}

/// Enqueue `req` on the raw CUDA stream `stream` (torch's current stream). No synchronisation.
///
/// A bad device-resident index recorded by an earlier launch is reported first (and this request
/// is then not run), so an error is never silently dropped.
pub fn execute(req: &TransferRequest, stream: u64) -> Result<()> {
    let pr = probe::ready()?;
    guard("hostkv_rs CUDA transfer", || {
        errword::take()?;
        let c = plan::validate(req)?;
        if c.len == 0 || c.layer_count == 0 {
            return Ok(());
        }
        match c.strategy {
            Strategy::PerItem => launch::run(req, &c, driver::as_stream(stream), &pr),
            Strategy::Runs | Strategy::PageBlocks => direct::run(req, stream, pr.driver_version),
        }
    })
}

/// Run the kernel backend's `.cu` code under the CPU emulation shim (device pointers are host
/// pointers). Used by tests to check the real kernel code without a GPU. The block quota comes
/// from `HOSTKV_BLOCK_QUOTA` as on a GPU. A bad `on_device` index is reported at once.
pub fn emulate(req: &TransferRequest) -> Result<()> {
    emulate::emulate_with_quota(req, params::block_quota()?)
}

/// Register `[ptr, ptr+len)` with cuMemHostRegister(PORTABLE|DEVICEMAP) in chunks that are whole
/// multiples of `granularity` (0 = one registration) and at most `chunk_limit` bytes. Returns the
/// registered ranges; on failure rolls back and returns an error carrying the contract's text.
pub fn register_host(
    ptr: u64,
    len: usize,
    granularity: usize,
    chunk_limit: usize,
) -> Result<Vec<(u64, usize)>> {
    guard("cudaHostRegister", || {
        register::register(ptr, len, granularity, chunk_limit)
    })
}

/// Unregister ranges returned by `register_host` (reverse order, errors ignored).
pub fn unregister_host(ranges: &[(u64, usize)]) {
    let _ = guard("cudaHostUnregister", || {
        register::unregister(ranges);
        Ok(())
    });
}

/// Report (and clear) a bad device-resident index recorded by a kernel since the last check.
pub fn check_device_errors() -> Result<()> {
    if !probe::initialised_here() {
        return Ok(());
    }
    guard("check_device_errors", errword::take)
}
