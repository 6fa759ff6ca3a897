//! The embedded PTX, loaded once per process as a context-independent library
//! (`cuLibraryLoadData`, CUDA 12.0+). Its kernels (`cuLibraryGetKernel`) are launched through
//! their `CUkernel` handles cast to `CUfunction`, which the driver launches in whatever context
//! is current: no per-context function handle can go stale when a primary context is reset or
//! another context is used.
//!
//! The JIT may run at load and again when a context first uses the library; both happen before
//! anything is enqueued, and count as blocking (`driver::may_block`): the first call per context
//! runs without the GIL.

use std::ffi::{c_uint, c_void};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::driver::{check, code, describe, lock_cache, may_block};
use super::{probe, ptx};
use crate::error::{Error, Result};

#[derive(Clone, Copy)]
pub(crate) struct Kernels {
    pub check: sys::CUfunction,
    pub transfer: sys::CUfunction,
}

/// `CUkernel` handles (process-wide; valid from any thread and context).
#[derive(Clone, Copy)]
struct Handles {
    check: usize,
    transfer: usize,
}

struct Loaded {
    kernels: Option<Handles>,
    /// Contexts (`probe::ctx_key`) the library has been loaded into (a handful per process).
    warm: Vec<u64>,
}

/// Against the GIL: a leaf lock in code that never calls Python, so it is never held while the
/// GIL is waited for (design.md, "Locks and the GIL").
static LOADED: Mutex<Loaded> = Mutex::new(Loaded {
    kernels: None,
    warm: Vec::new(),
});

/// The kernels, usable in context `ctx` (current on this thread).
pub(crate) fn kernels(ctx: sys::CUcontext, driver_version: i32) -> Result<Kernels> {
    let mut guard = lock_cache(&LOADED)?;
    let h = match guard.kernels {
        Some(h) => h,
        None => {
            may_block()?;
            let h = load(driver_version)?;
            guard.kernels = Some(h);
            h
        }
    };
    let key = probe::ctx_key(ctx);
    if !guard.warm.contains(&key) {
        // Loads the library into this context now (the per-context JIT), rather than inside a
        // launch.
        may_block()?;
        for (k, name) in [(h.check, "hkv_check_indices"), (h.transfer, "hkv_transfer")] {
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: `k` is a kernel handle of the library loaded once for the process (never
            // unloaded); `f` is a valid out-pointer; a context is current.
            let rc = unsafe { sys::cuKernelGetFunction(&mut f, k as sys::CUkernel) };
            if rc != sys::cudaError_enum::CUDA_SUCCESS {
                let rc = code(rc);
                // With lazy loading the JIT runs here, and the driver keeps no log of it: for a
                // JIT failure, compile the same PTX eagerly into this context to get the log.
                let mut text = super::driver::error_string(rc);
                if JIT_FAILURES.contains(&rc) {
                    text.push_str(&format!(
                        "; driver version {driver_version}; JIT log (from an eager compile of \
                         the same PTX): {}",
                        eager_jit_log()
                    ));
                }
                return Err(crate::error::DriverError {
                    call: format!("cuKernelGetFunction ({name}), loading the hostkv_rs kernels"),
                    code: rc,
                    name: super::driver::error_name(rc),
                    text,
                }
                .into());
            }
        }
        guard.warm.push(key);
    }
    Ok(Kernels {
        check: h.check as sys::CUfunction,
        transfer: h.transfer as sys::CUfunction,
    })
}

/// Codes that mean the JIT rejected the PTX (invalid image, no binary for this GPU, invalid PTX,
/// unsupported PTX version, JIT compiler not found), where a log says why.
const JIT_FAILURES: [i32; 5] = [200, 209, 218, 222, 221];

/// The JIT's error log for the embedded PTX, from an eager `cuModuleLoadDataEx` in the current
/// context (unloaded again), or what stood in the way of getting one.
fn eager_jit_log() -> String {
    let mut log = JitLog::new();
    let mut module: sys::CUmodule = std::ptr::null_mut();
    let (mut opts, mut vals) = log.options();
    // SAFETY: NUL-terminated PTX image; option arrays of equal length that outlive the call.
    let rc = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            ptx::PTX.as_ptr().cast(),
            opts.len() as c_uint,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
        )
    };
    if rc == sys::cudaError_enum::CUDA_SUCCESS {
        // SAFETY: the module just loaded, used for nothing else.
        let _ = unsafe { sys::cuModuleUnload(module) };
        return "none: an eager compile succeeded (the failure is the context's, not the PTX's)"
            .into();
    }
    let text = log.error();
    if text.is_empty() {
        format!("empty ({} from the eager compile)", describe(code(rc)))
    } else {
        text
    }
}

/// JIT log buffers and the `cuLibraryLoadData` / `cuModuleLoadDataEx` options that fill them.
struct JitLog {
    err: Vec<u8>,
    info: Vec<u8>,
}

impl JitLog {
    const LEN: usize = 8192;

    fn new() -> Self {
        Self {
            err: vec![0; Self::LEN],
            info: vec![0; Self::LEN],
        }
    }

    /// Option values are passed as pointer-sized words: sizes by value, buffers by address.
    fn options(&mut self) -> ([sys::CUjit_option; 4], [*mut c_void; 4]) {
        use sys::CUjit_option_enum as O;
        (
            [
                O::CU_JIT_ERROR_LOG_BUFFER,
                O::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
                O::CU_JIT_INFO_LOG_BUFFER,
                O::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
            ],
            [
                self.err.as_mut_ptr().cast(),
                Self::LEN as *mut c_void,
                self.info.as_mut_ptr().cast(),
                Self::LEN as *mut c_void,
            ],
        )
    }

    fn error(&self) -> String {
        let end = self
            .err
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.err.len());
        String::from_utf8_lossy(&self.err[..end]).trim().to_string()
    }
}

fn load(driver_version: i32) -> Result<Handles> {
    if driver_version < 12000 {
        return Err(Error::cuda_unavailable(format!(
            "the hostkv_rs kernels need a CUDA 12.0 or newer driver (PTX ISA 8.0, \
             cuLibraryLoadData); this driver is {driver_version}"
        )));
    }
    let mut log = JitLog::new();
    let (mut opts, mut vals) = log.options();
    let mut lib: sys::CUlibrary = std::ptr::null_mut();
    // SAFETY: NUL-terminated PTX image; option arrays of equal length that outlive the call; no
    // library options.
    let rc = unsafe {
        sys::cuLibraryLoadData(
            &mut lib,
            ptx::PTX.as_ptr().cast(),
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
            opts.len() as c_uint,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != sys::cudaError_enum::CUDA_SUCCESS {
        return Err(Error::cuda(format!(
            "loading the hostkv_rs kernels (PTX ISA 8.0, sm_80) failed: {}; driver version {}; \
             JIT log: {}",
            describe(code(rc)),
            driver_version,
            log.error()
        )));
    }
    let get = |name: &[u8]| -> Result<usize> {
        let mut k: sys::CUkernel = std::ptr::null_mut();
        check(
            // SAFETY: `lib` was just loaded and is never unloaded; `name` is one of the
            // NUL-terminated kernel names; `k` is a valid out-pointer.
            unsafe { sys::cuLibraryGetKernel(&mut k, lib, name.as_ptr().cast()) },
            "cuLibraryGetKernel",
        )?;
        Ok(k as usize)
    };
    // The library stays loaded for the life of the process.
    Ok(Handles {
        check: get(ptx::KERNEL_CHECK)?,
        transfer: get(ptx::KERNEL_TRANSFER)?,
    })
}
