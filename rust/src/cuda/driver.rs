//! Thin helpers over the CUDA driver API as cudarc exposes it (`cudarc::driver::sys`).
//!
//! Every function here may only run after `probe` has seen libcuda (`is_culib_present`): with
//! dynamic loading cudarc panics, instead of returning an error, when the library is missing.
//! Entry points of the CUDA module therefore run their bodies under [`guard`].

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, TryLockError};

use cudarc::driver::sys;

use crate::error::{CudaError, DriverError, Error, Result};

pub(crate) use sys::cudaError_enum as Cu;

/// Runs `f`, turning a panic (a missing driver symbol, a cudarc bug) into an error so it can
/// never unwind into Python.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(Error::cuda(format!(
                "{what}: internal error in the CUDA driver binding: {msg}"
            )))
        }
    }
}

fn static_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the driver returns pointers to static NUL-terminated strings.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

type RawErrFn = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// `cuGetErrorString`/`cuGetErrorName` looked up with an integer error type: codes returned by
/// symbols we resolve ourselves need not be members of cudarc's `CUresult` enum.
fn raw_err_fn(name: &[u8]) -> Option<RawErrFn> {
    // SAFETY: only called after the library was found; the symbol has this C signature.
    unsafe {
        let lib = sys::culib();
        lib.get::<RawErrFn>(name).ok().map(|s| *s)
    }
}

/// The driver's description of an error code, like `cudaGetErrorString`.
pub(crate) fn error_string(rc: i32) -> String {
    let mut p: *const c_char = std::ptr::null();
    match raw_err_fn(b"cuGetErrorString\0") {
        // SAFETY: valid out-pointer; unknown codes make the driver return an error, not crash.
        Some(f) if unsafe { f(rc, &mut p) } == 0 => {
            static_str(p).unwrap_or_else(|| "unknown error".into())
        }
        _ => "unrecognized error code".into(),
    }
}

pub(crate) fn error_name(rc: i32) -> String {
    let mut p: *const c_char = std::ptr::null();
    match raw_err_fn(b"cuGetErrorName\0") {
        // SAFETY: as in `error_string`.
        Some(f) if unsafe { f(rc, &mut p) } == 0 => {
            static_str(p).unwrap_or_else(|| format!("CUDA error {rc}"))
        }
        _ => format!("CUDA error {rc}"),
    }
}

/// `NAME (rc=N): description`.
pub(crate) fn describe(rc: i32) -> String {
    format!("{} (rc={rc}): {}", error_name(rc), error_string(rc))
}

pub(crate) fn code(r: sys::CUresult) -> i32 {
    r as i32
}

/// `Err(Error::Driver)` naming the call and its code unless `r` is success.
pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == Cu::CUDA_SUCCESS {
        Ok(())
    } else {
        let rc = code(r);
        Err(DriverError {
            call: what.to_owned(),
            code: rc,
            name: error_name(rc),
            text: error_string(rc),
        }
        .into())
    }
}

/// Looks a driver symbol up by name without cudarc's panic on a missing symbol.
///
/// # Safety
/// `F` must be the symbol's real C signature.
pub(crate) unsafe fn symbol<F: Copy>(name: &[u8]) -> Option<F> {
    // SAFETY: `culib` loads (once) the driver library the probe found present; `get` reads the
    // symbol as `F`, which the caller guarantees is its real signature. The library is never
    // unloaded, so the copied function pointer stays valid.
    unsafe {
        let lib = sys::culib();
        lib.get::<F>(name).ok().map(|s| *s)
    }
}

type ExchangeCaptureMode = unsafe extern "C" fn(*mut c_int) -> c_int;

/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// This thread in relaxed stream-capture mode until dropped (`cuThreadExchangeStreamCaptureMode`).
///
/// While any thread captures a CUDA graph in global mode (torch's default), "potentially
/// unsafe" driver calls from other threads (allocating, pinning, loading modules, querying or
/// waiting on events and streams) fail and invalidate that capture. The calls hostkv_rs makes
/// around a transfer never touch a capturing stream (`refuse_capture` refuses one first), so
/// they are safe to make in relaxed mode and must not break someone else's graph.
pub(crate) struct RelaxedCapture {
    exchange: Option<ExchangeCaptureMode>,
    previous: c_int,
    /// The mode is this thread's: the guard must be dropped on the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl RelaxedCapture {
    pub(crate) fn enter() -> Self {
        // Only once the driver is loaded and initialised here: looking the symbol up earlier would
        // load the library (cudarc panics where there is none), and without CUDA state there is
        // nothing to protect.
        let inactive = Self {
            exchange: None,
            previous: 0,
            _not_send: std::marker::PhantomData,
        };
        if !super::probe::initialised_here() {
            return inactive;
        }
        static EXCHANGE: std::sync::OnceLock<Option<ExchangeCaptureMode>> =
            std::sync::OnceLock::new();
        // SAFETY: the driver's signature for this symbol (CUstreamCaptureMode is a C enum).
        let exchange = *EXCHANGE.get_or_init(|| unsafe {
            symbol::<ExchangeCaptureMode>(b"cuThreadExchangeStreamCaptureMode\0")
        });
        let Some(f) = exchange else {
            return inactive;
        };
        let mut mode = CAPTURE_MODE_RELAXED;
        // SAFETY: valid in/out pointer to one mode value.
        if unsafe { f(&mut mode) } != 0 {
            return inactive;
        }
        Self {
            exchange: Some(f),
            previous: mode,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(f) = self.exchange {
            let mut mode = self.previous;
            // SAFETY: as in `enter`; restores the mode this thread had.
            let _ = unsafe { f(&mut mode) };
        }
    }
}

pub(crate) fn as_stream(stream: u64) -> sys::CUstream {
    stream as usize as sys::CUstream
}

pub(crate) fn as_void(p: u64) -> *mut c_void {
    p as usize as *mut c_void
}

thread_local! {
    /// Set while `cuda::try_execute` runs on this thread: anything that would block returns
    /// `Error::Cuda(CudaError::WouldBlock)` instead, before the first enqueue.
    static NO_BLOCK: Cell<bool> = const { Cell::new(false) };
}

/// `Err(Error::Cuda(CudaError::WouldBlock))` when the calling thread asked not to block. Called before every step
/// that may wait (JIT, pinned or device allocation, a stream/event wait, a context creation).
pub(crate) fn may_block() -> Result<()> {
    if NO_BLOCK.with(Cell::get) {
        Err(Error::Cuda(CudaError::WouldBlock))
    } else {
        Ok(())
    }
}

/// Marks the calling thread as "must not block" until dropped.
pub(crate) struct NoBlock(bool);

impl NoBlock {
    pub(crate) fn enter() -> Self {
        NoBlock(NO_BLOCK.with(|c| c.replace(true)))
    }
}

impl Drop for NoBlock {
    fn drop(&mut self) {
        let prev = self.0;
        NO_BLOCK.with(|c| c.set(prev));
    }
}

/// Locks a cache whose holder may be blocked in the driver (JIT, allocation): in "must not block"
/// mode a held lock is `Error::Cuda(CudaError::WouldBlock)`, so a thread holding the GIL never waits for one. A
/// poisoned lock is still used: every update of these caches is a single insert.
pub(crate) fn lock_cache<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    if NO_BLOCK.with(Cell::get) {
        match m.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(Error::Cuda(CudaError::WouldBlock)),
        }
    } else {
        Ok(m.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[cfg(test)]
mod abi_tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    /// The Rust side of tests/abi/cuda_abi.cpp (which checks the same numbers against NVIDIA's
    /// cuda.h): what cudarc's bindings and our hand-written constants say.
    #[test]
    fn abi_constants_match_the_c_probe() {
        type Attrs = sys::CUmemcpyAttributes;
        assert_eq!(size_of::<Attrs>(), 24);
        assert_eq!(offset_of!(Attrs, srcAccessOrder), 0);
        assert_eq!(offset_of!(Attrs, srcLocHint), 4);
        assert_eq!(offset_of!(Attrs, dstLocHint), 12);
        assert_eq!(offset_of!(Attrs, flags), 20);
        use sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM as ORDER_STREAM;
        assert_eq!(ORDER_STREAM as i32, 1);
        assert_eq!(
            sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as i32,
            1
        );
        assert_eq!(
            sys::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as i32,
            9
        );
        assert_eq!(sys::CUstream_flags::CU_STREAM_NON_BLOCKING as i32, 1);
        assert_eq!(sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as i32, 2);
        assert_eq!(CAPTURE_MODE_RELAXED, 2);
        assert_eq!(
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED as i32,
            CAPTURE_MODE_RELAXED
        );
        assert_eq!(size_of::<sys::CUdeviceptr>(), 8);
        assert_eq!(size_of::<sys::CUkernel>(), size_of::<sys::CUfunction>());
    }
}
