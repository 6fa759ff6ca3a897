//! The kernel backend on a GPU: marshal the request, stage host-resident indices (and an
//! oversized layer table) and copy them to device scratch with one async copy, then launch the
//! index check (when some indices live on the GPU) and the copy kernel on the caller's stream.

use std::ffi::{c_int, c_void};

use cudarc::driver::sys;

use super::driver::{check, code, describe};
use super::params::{self, HkvParams, BLOCK_THREADS};
use super::probe::Probe;
use super::{error_record, module, probe, staging};
use crate::error::{Error, Result};
use crate::plan::Checked;
use crate::request::TransferRequest;

fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// The device address of host plane `base..base+nbytes`, which must be registered (pinned and
/// mapped) as one contiguous device range; an unregistered plane would make the kernel fault.
fn device_view_of_plane(plane: usize, base: u64, nbytes: u64) -> Result<u64> {
    let dev_of = |p: u64| -> Result<u64> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the driver only looks the address up.
        let rc = unsafe {
            sys::cuPointerGetAttribute(
                (&mut d as *mut sys::CUdeviceptr).cast(),
                sys::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                p,
            )
        };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(Error::cuda(format!(
                "host plane {plane} at {p:#x} is not registered with CUDA ({}); the kernel \
                 backend needs pinned host memory (register the pool: pin_memory=True)",
                describe(code(rc))
            )));
        }
        Ok(d)
    };
    let first = dev_of(base)?;
    if nbytes > 1 {
        let last = dev_of(base + nbytes - 1)?;
        if last != first + nbytes - 1 {
            return Err(Error::cuda(format!(
                "host plane {plane} is not mapped as one contiguous device range (device \
                 addresses {first:#x}..{last:#x} for {nbytes} bytes); unified addressing is \
                 required"
            )));
        }
    }
    Ok(first)
}

fn launch(f: sys::CUfunction, p: &HkvParams, grid: u32, stream: sys::CUstream) -> Result<()> {
    let mut arg = p as *const HkvParams as *mut c_void;
    // SAFETY: one by-value struct argument whose layout matches the kernel's (tested); the
    // driver copies it before returning.
    check(
        unsafe {
            sys::cuLaunchKernel(
                f,
                grid,
                1,
                1,
                BLOCK_THREADS,
                1,
                1,
                0,
                stream,
                &mut arg,
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernel",
    )
}

/// Every device layer pointer and GPU-resident index array must be on the device whose context
/// runs the kernel; the kernel could not read another GPU's memory (no peer mapping is set up)
/// and would fault. Pointers the driver cannot place are left to the caller's contract.
fn check_same_device(ordinal: c_int, req: &TransferRequest) -> Result<()> {
    let refuse = |what: String, p: u64, o: c_int| {
        Err(Error::transfer(format!(
            "{what} ({p:#x}) is on CUDA device {o}, but this transfer runs on device {ordinal} \
             (the device of the first device layer): every device tensor and GPU-resident index \
             array of one transfer must be on the same device"
        )))
    };
    for (k, &p) in req.device().layer_ptrs.iter().enumerate() {
        match probe::pointer_device(p) {
            Some(o) if o != ordinal => return refuse(format!("device layer pointer {k}"), p, o),
            _ => {}
        }
    }
    for (side, idx) in [("host", req.host_idx()), ("device", req.dev_idx())] {
        if idx.on_device && idx.len > 0 {
            match probe::pointer_device(idx.ptr) {
                Some(o) if o != ordinal => {
                    return refuse(format!("the GPU-resident {side} index array"), idx.ptr, o)
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Enqueues the kernels of `req` on `stream` in context `ctx` (current on this thread). Sets
/// `enqueued` once anything was queued (the caller then records its event behind it).
pub(crate) fn run(
    req: &TransferRequest,
    c: &Checked,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    pr: &Probe,
    enqueued: &mut bool,
) -> Result<()> {
    let ordinal = probe::current_device()?;
    if let Some(d) = pr.devices.get(ordinal as usize) {
        if !d.unified_addressing {
            return Err(Error::cuda_unavailable(format!(
                "device {ordinal} ({}) has no unified addressing; the kernel backend needs it",
                d.name
            )));
        }
    }
    check_same_device(ordinal, req)?;
    let quota = crate::config::block_quota()?;
    let kernels = module::kernels(ctx, pr.driver_version)?;
    let mut m = params::marshal(req, c)?;
    for p in 0..c.nplanes {
        let nbytes = c.planes[p].map(|pl| pl.nbytes).unwrap_or(0);
        m.params.host_base[p] = device_view_of_plane(p, m.params.host_base[p], nbytes)?;
    }
    (m.params.err, m.params.dev_err) = error_record::device_ptrs(ctx)?;

    // Lay out the staging pair: [layer table][host indices][device indices], 16-aligned.
    let table_bytes = m.table.as_ref().map_or(0, |t| t.len() * 8);
    let host_idx_bytes = if req.host_idx().on_device {
        0
    } else {
        req.host_idx().len * req.host_idx().width.bytes()
    };
    let dev_idx_bytes = if req.dev_idx().on_device {
        0
    } else {
        req.dev_idx().len * req.dev_idx().width.bytes()
    };
    let off_host = align16(table_bytes);
    let off_dev = off_host + align16(host_idx_bytes);
    let total = off_dev + align16(dev_idx_bytes);
    let lease = if total > 0 {
        Some(staging::acquire(ctx, total)?)
    } else {
        None
    };
    let mut result = Ok(());
    if let Some(l) = &lease {
        // SAFETY: the lease's host buffer holds `total` bytes that no queued copy reads any more
        // (staging::acquire), laid out as [table][host indices][device indices] with each part
        // inside it. A host-resident index array is `len * width` bytes of CPU memory
        // (`TransferRequest::new`; its raw `len`, which the staged copy takes whole so that the
        // kernels can apply the array's map), read here, before the call returns.
        unsafe {
            if let Some(t) = &m.table {
                std::ptr::copy_nonoverlapping(t.as_ptr().cast::<u8>(), l.host, table_bytes);
                m.params.dev_table = l.dev;
            }
            if host_idx_bytes > 0 {
                std::ptr::copy_nonoverlapping(
                    req.host_idx().ptr as *const u8,
                    l.host.add(off_host),
                    host_idx_bytes,
                );
                m.params.host_idx = l.dev + off_host as u64;
            }
            if dev_idx_bytes > 0 {
                std::ptr::copy_nonoverlapping(
                    req.dev_idx().ptr as *const u8,
                    l.host.add(off_dev),
                    dev_idx_bytes,
                );
                m.params.dev_idx = l.dev + off_dev as u64;
            }
        }
        // One copy per call into device scratch, ahead of the kernels on the same stream.
        result = staging::upload(l, total, stream);
        *enqueued |= result.is_ok();
    }

    // Every launch gets a sequence number: its slot in the abort ring marks it refused (and
    // counted) at most once.
    m.params.abort_seq = error_record::next_seq();
    if result.is_ok() && (req.host_idx().on_device || req.dev_idx().on_device) {
        let grid = params::check_grid(m.params.n, quota);
        result = launch(kernels.check, &m.params, grid, stream);
        *enqueued |= result.is_ok();
    }
    if result.is_ok() {
        let grid = params::transfer_grid(m.tasks, quota);
        result = launch(kernels.transfer, &m.params, grid, stream);
        *enqueued |= result.is_ok();
    }
    if let Some(l) = lease {
        // Once anything was queued the pair stays busy until the stream passes this point; if
        // nothing was, it is free at once.
        let released = staging::release(l, enqueued.then_some(stream));
        result = result.and(released);
    }
    result
}
