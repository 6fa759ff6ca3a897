//! Runs the kernels of rust/kernels/hostkv_transfer.cu on the CPU (compiled by build.rs under
//! rust/kernels/emu_shim.h), with the same parameter block the GPU launch builds. Device
//! pointers are host pointers here, and `on_device` index arrays are read only by the kernels,
//! exactly as on a GPU.

use std::ffi::{c_int, c_uint};

use super::error_record;
use super::params::{self, HkvDeviceRecord, HkvErrorRecord, HkvParams, ABORT_RING, BLOCK_THREADS};
use crate::error::{Error, Result};
use crate::plan::{self, Strategy};
use crate::request::{DeviceMemory, TransferRequest};

extern "C" {
    fn hkv_emu_launch(
        kernel: c_int,
        params: *const HkvParams,
        grid: c_uint,
        block: c_uint,
    ) -> c_int;
    #[cfg(test)]
    pub(crate) fn hkv_params_layout(out: *mut u64, cap: c_uint);
}

const KERNEL_CHECK: c_int = 0;
const KERNEL_TRANSFER: c_int = 1;

fn launch(kernel: c_int, p: &HkvParams, grid: u32) -> Result<()> {
    // SAFETY: `p` was marshalled from a request over `DeviceMemory::Host` (checked by
    // `emulate_with_quota`) that passed `plan::check_structure`: by `TransferRequest::new`, its
    // planes, device layers and index arrays (also `on_device` ones) are live CPU memory of the
    // sizes in `p`. `dev_table` and the error records point at this call's own allocations,
    // alive until it returns. The kernels check every index against `host_rows` / `dev_rows`
    // before they address a row, so they touch nothing else.
    let rc = unsafe { hkv_emu_launch(kernel, p, grid, BLOCK_THREADS) };
    if rc != 0 {
        return Err(Error::cuda(format!(
            "emulated launch of kernel {kernel} failed ({rc})"
        )));
    }
    Ok(())
}

/// `cuda::emulate` with an explicit block quota (tests vary it without touching the
/// environment).
pub(crate) fn emulate_with_quota(req: &TransferRequest, quota: u32) -> Result<()> {
    if req.device().memory != DeviceMemory::Host {
        return Err(Error::unsupported(
            "the kernel emulation runs on the CPU and cannot reach CUDA device memory",
        ));
    }
    let c = plan::validate(req)?;
    if c.len == 0 {
        return Ok(());
    }
    if c.strategy != Strategy::PerItem {
        // The direct backend has no kernel: on a GPU its plan goes to the copy engine as is.
        return crate::cpu::execute(&plan::build(req)?);
    }
    let mut m = params::marshal(req, &c)?;
    if let Some(table) = &m.table {
        m.params.dev_table = table.as_ptr() as u64;
    }
    // Both records in plain memory ("device" pointers are host pointers here).
    let mut record = Box::new(HkvErrorRecord::default());
    let mut dev_record = Box::new(HkvDeviceRecord {
        claim: 0,
        aborted: 0,
        abort_ring: [0; ABORT_RING],
    });
    m.params.err = &mut *record as *mut HkvErrorRecord as u64;
    m.params.dev_err = &mut *dev_record as *mut HkvDeviceRecord as u64;
    m.params.abort_seq = 1;
    if req.host_idx().on_device || req.dev_idx().on_device {
        launch(
            KERNEL_CHECK,
            &m.params,
            params::check_grid(m.params.n, quota),
        )?;
    }
    if m.tasks > 0 {
        launch(
            KERNEL_TRANSFER,
            &m.params,
            params::transfer_grid(m.tasks, quota),
        )?;
    }
    let mut reported = 0;
    // SAFETY: the kernels have returned; the record is ours.
    match unsafe { error_record::consume(&mut *record, &mut reported) } {
        None => Ok(()),
        Some(msg) => Err(Error::transfer(msg)),
    }
}
