//! The embedded PTX, JIT-loaded once per CUDA context on first use.

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::driver::{check, code, describe};
use super::ptx;
use crate::error::{Error, Result};

#[derive(Clone, Copy)]
pub(crate) struct Kernels {
    pub check: sys::CUfunction,
    pub transfer: sys::CUfunction,
}

// CUfunction handles are plain driver handles, valid from any thread of the process.
#[derive(Clone, Copy)]
struct Handles(usize, usize);

static LOADED: Mutex<Option<HashMap<usize, Handles>>> = Mutex::new(None);

/// The kernels in context `ctx` (current on this thread), loading the module if needed.
pub(crate) fn kernels(ctx: sys::CUcontext, driver_version: i32) -> Result<Kernels> {
    let mut guard = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(h) = map.get(&(ctx as usize)) {
        return Ok(Kernels {
            check: h.0 as sys::CUfunction,
            transfer: h.1 as sys::CUfunction,
        });
    }
    let module = load(driver_version)?;
    let get = |name: &[u8]| -> Result<sys::CUfunction> {
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` is loaded, `name` NUL-terminated.
        check(
            unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr().cast()) },
            "cuModuleGetFunction",
        )?;
        Ok(f)
    };
    let k = Kernels {
        check: get(ptx::KERNEL_CHECK)?,
        transfer: get(ptx::KERNEL_TRANSFER)?,
    };
    map.insert(ctx as usize, Handles(k.check as usize, k.transfer as usize));
    Ok(k)
}

fn load(driver_version: i32) -> Result<sys::CUmodule> {
    const LOG: usize = 8192;
    let mut err_log = vec![0u8; LOG];
    let mut info_log = vec![0u8; LOG];
    use sys::CUjit_option_enum as O;
    let mut opts = [
        O::CU_JIT_ERROR_LOG_BUFFER,
        O::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        O::CU_JIT_INFO_LOG_BUFFER,
        O::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
    ];
    // Option values are passed as pointer-sized words: sizes by value, buffers by address.
    let mut vals: [*mut c_void; 4] = [
        err_log.as_mut_ptr().cast(),
        LOG as *mut c_void,
        info_log.as_mut_ptr().cast(),
        LOG as *mut c_void,
    ];
    let mut module: sys::CUmodule = std::ptr::null_mut();
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
    if rc != sys::cudaError_enum::CUDA_SUCCESS {
        let text = |buf: &[u8]| {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            String::from_utf8_lossy(&buf[..end]).trim().to_string()
        };
        return Err(Error::Cuda(format!(
            "loading the hostkv_rs kernels (PTX ISA 8.0, sm_80) failed: {}; driver version {}; \
             JIT log: {}",
            describe(code(rc)),
            driver_version,
            text(&err_log)
        )));
    }
    Ok(module)
}
