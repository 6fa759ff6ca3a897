//! CUDA path: driver probe, pinned registration, PTX kernel launches, batched direct copies, and
//! (feature `emulator`) the CPU emulation of the kernels. See docs/cuda.md.
//!
//! Nothing here touches CUDA until one of these functions is called, every driver call is
//! preceded by `is_culib_present` (cudarc panics instead of failing when libcuda is missing) and
//! runs under `catch_unwind`, so no panic can reach Python.

mod direct;
mod driver;
#[cfg(feature = "emulator")]
mod emulate;
mod error_record;
mod launch;
mod module;
mod params;
mod probe;
mod ptx;
mod register;
mod registry;
mod staging;

// The kernels against the CPU engine: they need the emulator.
#[cfg(all(test, feature = "emulator"))]
mod tests;

use cudarc::driver::sys;

use crate::error::{CudaError, Error, Result};
use crate::plan::{self, Strategy};
use crate::request::TransferRequest;
use driver::guard;

/// True when libcuda can be loaded and a device answers. Never panics.
pub fn available() -> bool {
    probe::ready().is_ok()
}

/// Human-readable reason why CUDA is or is not usable (driver version, device, library path).
pub fn runtime_info() -> String {
    probe::describe(&probe::probe())
}

/// Enqueue `req` on the raw CUDA stream `stream` (torch's current stream). No synchronisation;
/// it may block (first-use JIT and allocations, a staging buffer still in use, GPU-resident
/// indices read back for the direct backend): call without the GIL.
///
/// A bad device-resident index recorded by an earlier launch is reported first (and this request
/// is then not run), so an error is never silently dropped.
pub fn execute(req: &TransferRequest, stream: u64) -> Result<()> {
    run(req, stream)
}

/// `execute`, unless it would have to block: then `Err(Error::Cuda(CudaError::WouldBlock))` with nothing
/// enqueued, and the caller retries with `execute` after releasing the GIL.
pub fn try_execute(req: &TransferRequest, stream: u64) -> Result<()> {
    let _no_block = driver::NoBlock::enter();
    if !probe::probed_here() {
        return Err(Error::Cuda(CudaError::WouldBlock));
    }
    run(req, stream)
}

fn run(req: &TransferRequest, stream: u64) -> Result<()> {
    let pr = probe::ready()?;
    guard("hostkv_rs CUDA transfer", || {
        let _relaxed = driver::RelaxedCapture::enter();
        error_record::take()?;
        let c = plan::validate(req)?;
        if c.len == 0 || c.layer_count == 0 {
            return Ok(());
        }
        // Held to the end: everything below belongs to the pointers' context.
        let scope = probe::bind_context(req.device().layer_ptrs.first().copied())?;
        let ctx = scope.ctx();
        let device = probe::current_device()?;
        refuse_capture(stream)?;
        // From here until the event is recorded, unregistering these planes waits for us.
        let planes: Vec<(u64, u64)> = (0..c.nplanes)
            .map(|p| {
                (
                    req.geom().plane_base[p],
                    c.planes[p].map_or(0, |pl| pl.nbytes),
                )
            })
            .collect();
        let entered = registry::enter(&planes)?;
        let mut enqueued = false;
        let result = match c.strategy {
            Strategy::PerItem => {
                launch::run(req, &c, ctx, driver::as_stream(stream), &pr, &mut enqueued)
            }
            Strategy::Runs | Strategy::PageBlocks => {
                direct::run(req, &c, stream, pr.driver_version, &entered, &mut enqueued)
            }
        };
        let recorded = if enqueued && entered.touches_registered() {
            entered.record(ctx, device, stream)
        } else {
            Ok(())
        };
        drop(entered);
        result.and(recorded)
    })
}

/// A transfer on a stream that is capturing a CUDA graph is refused before anything is
/// enqueued: captured copies would run whenever the graph is replayed, long after the staging
/// buffers, events and index checks of this call were recycled.
fn refuse_capture(stream: u64) -> Result<()> {
    let mut status: u32 = 0;
    // SAFETY: valid out-pointer for the 32-bit enum the driver writes; a context is current.
    let rc = unsafe {
        sys::cuStreamIsCapturing(driver::as_stream(stream), (&mut status as *mut u32).cast())
    };
    const STREAM_CAPTURE_IMPLICIT: i32 = 906;
    let which = if stream <= 1 {
        format!("the legacy default stream ({stream:#x})")
    } else {
        format!("CUDA stream {stream:#x}")
    };
    match driver::code(rc) {
        0 if status == 0 => Ok(()),
        0 => Err(Error::cuda(format!(
            "{which} is capturing a CUDA graph (capture status {status}): hostkv_rs transfers \
             cannot be captured (their index checks, staging buffers and events belong to this \
             call); run the transfer outside the capture. Nothing was enqueued"
        ))),
        STREAM_CAPTURE_IMPLICIT => Err(Error::cuda(format!(
            "{which} cannot be used while another thread captures a CUDA graph in global mode \
             (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT); use a side stream. Nothing was enqueued"
        ))),
        other => Err(Error::cuda(format!(
            "cuStreamIsCapturing({which}) failed: {}",
            driver::describe(other)
        ))),
    }
}

/// Run the kernel backend's `.cu` code under the CPU emulation shim (device pointers are host
/// pointers). Used by tests to check the real kernel code without a GPU. The block quota comes
/// from `HOSTKV_BLOCK_QUOTA` as on a GPU. A bad `on_device` index is reported at once.
#[cfg(feature = "emulator")]
pub fn emulate(req: &TransferRequest) -> Result<()> {
    emulate::emulate_with_quota(req, crate::config::block_quota()?)
}

/// Built without the `emulator` feature (the wheel): refuses, saying how to get the emulator.
#[cfg(not(feature = "emulator"))]
pub fn emulate(_req: &TransferRequest) -> Result<()> {
    Err(Error::unsupported(
        "the CUDA kernel emulator is not built into this hostkv_rs core (engine 'emulated' \
         needs the cargo feature `emulator`: scripts/dev_build.sh, or `maturin build --features \
         python,emulator`); use engine 'plan'",
    ))
}

/// Register `[ptr, ptr+len)` with cuMemHostRegister(PORTABLE|DEVICEMAP) in chunks that are whole
/// multiples of `granularity` (0: 4 KiB) and at most `chunk_limit` bytes, halving a refused
/// chunk down to one copy unit. Returns the registered ranges; on failure rolls back and returns
/// an error carrying the contract's text. `device`: the GPU whose context registers it (None:
/// the thread's current context, else device 0). Blocks: call without the GIL.
///
/// # Safety
/// `[ptr, ptr+len)` is a live mapping of the caller's that stays mapped, and is not registered
/// by anyone else, from this call until `unregister_host` of the returned ranges has returned
/// `Ok` (on `Err` it is still pinned and must stay mapped). The registry keeps these addresses
/// and transfers whose host planes lie inside them send DMA there.
pub unsafe fn register_host(
    ptr: u64,
    len: usize,
    granularity: usize,
    chunk_limit: usize,
    device: Option<i32>,
) -> Result<Vec<(u64, usize)>> {
    guard("cudaHostRegister", || {
        probe::ready()?;
        let _relaxed = driver::RelaxedCapture::enter();
        // SAFETY: this function's own contract, passed on.
        unsafe { register::register(ptr, len, granularity, chunk_limit, device) }
    })
}

/// Unregister ranges returned by `register_host`, each on the device it was registered on, after
/// the transfers queued on them (and only those) have finished. The wait is bounded
/// (`HOSTKV_UNREGISTER_TIMEOUT_S`, default 60 s): past it the ranges stay pinned and an error is
/// returned (the caller must then not unmap them). Blocks: call without the GIL.
///
/// Safe: it dereferences nothing, and only unpins a region the registry recorded, after every
/// transfer that entered it has recorded its event and that work has finished; a transfer that
/// comes later finds the region unregistered and is refused.
pub fn unregister_host(ranges: &[(u64, usize)]) -> Result<()> {
    guard("cudaHostUnregister", || {
        let _relaxed = driver::RelaxedCapture::enter();
        register::unregister(ranges)
    })
}

/// Report (and clear) a bad device-resident index recorded by a kernel since the last check.
pub fn check_device_errors() -> Result<()> {
    if !probe::initialised_here() {
        return Ok(());
    }
    guard("check_device_errors", || {
        let _relaxed = driver::RelaxedCapture::enter();
        error_record::take()
    })
}
