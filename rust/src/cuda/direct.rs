//! The direct backend on a GPU: the validated plan (coalesced runs, or `P * I` page blocks) goes
//! to the copy engine as one `cuMemcpyBatchAsync` where the driver has it, else one
//! `cuMemcpyAsync` per copy.
//!
//! The batch entry point changed ABI in CUDA 13 (`failIdx` removed; the new one is exported as
//! `cuMemcpyBatchAsync_v2`). Our bindings are 12.8-level, so the variant is chosen from
//! `cuDriverGetVersion` at run time and both are looked up by name, never called through a
//! signature fixed at build time (SGLang's segfault, issues #21869 / #36302).

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::driver::{as_stream, check, code, describe, may_block, symbol};
use super::probe;
use super::registry::{self, Entered};
use crate::error::{Error, Result};
use crate::plan::{self, Checked, CopyOp};
use crate::transfer::{IndexArray, TransferRequest};

type BatchV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> c_int;
type BatchV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> c_int;

#[derive(Clone, Copy)]
enum Batch {
    /// CUDA 12.8 / 12.9 drivers.
    V1(BatchV1),
    /// CUDA 13.x drivers.
    V2(BatchV2),
    None,
}

/// The batch entry point for this driver, resolved once.
fn batch_fn(driver_version: i32) -> Batch {
    static F: OnceLock<Batch> = OnceLock::new();
    *F.get_or_init(|| {
        // SAFETY: the symbols have exactly these C signatures in their CUDA versions.
        unsafe {
            if driver_version >= 13000 {
                symbol::<BatchV2>(b"cuMemcpyBatchAsync_v2\0").map_or(Batch::None, Batch::V2)
            } else if driver_version >= 12080 {
                symbol::<BatchV1>(b"cuMemcpyBatchAsync\0").map_or(Batch::None, Batch::V1)
            } else {
                Batch::None
            }
        }
    })
}

/// Set once the driver answered CUDA_ERROR_NOT_SUPPORTED: later calls go straight to the
/// per-copy path instead of asking again.
static BATCH_REFUSED: AtomicBool = AtomicBool::new(false);

/// `HOSTKV_DIRECT_BATCH=0` forces the per-copy path (a diagnostic switch).
fn batch_enabled() -> bool {
    !BATCH_REFUSED.load(Ordering::Relaxed)
        && std::env::var("HOSTKV_DIRECT_BATCH").map_or(true, |v| v.trim() != "0")
}

const CUDA_ERROR_NOT_SUPPORTED: c_int = 801;
/// Copies per batch call; bounds the temporary arrays of one submission.
const MAX_BATCH: usize = 1 << 16;

fn location(host: bool, ordinal: c_int) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: if host {
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
        } else {
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        },
        id: if host { 0 } else { ordinal },
    }
}

/// Submits `ops` on `stream`; `to_host` says which side each op's destination is. Sets
/// `enqueued` once any copy was queued.
fn submit(
    ops: &[CopyOp],
    to_host: bool,
    stream: u64,
    driver_version: i32,
    enqueued: &mut bool,
) -> Result<()> {
    let s = as_stream(stream);
    // The legacy NULL stream (0, or CU_STREAM_LEGACY = 1) is rejected by the batch API.
    let legacy = stream <= 1;
    let batch = if legacy || !batch_enabled() {
        Batch::None
    } else {
        batch_fn(driver_version)
    };
    if !matches!(batch, Batch::None) {
        let ordinal = probe::current_device()?;
        let mut attr = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: location(!to_host, ordinal),
            dstLocHint: location(to_host, ordinal),
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        };
        let mut done = 0;
        for chunk in ops.chunks(MAX_BATCH) {
            let mut dsts: Vec<u64> = chunk.iter().map(|o| o.dst).collect();
            let mut srcs: Vec<u64> = chunk.iter().map(|o| o.src).collect();
            let mut sizes: Vec<usize> = chunk.iter().map(|o| o.len as usize).collect();
            let mut attr_idx = [0usize];
            let mut fail_idx = usize::MAX;
            // SAFETY: arrays of `chunk.len()` entries and one attribute record, alive for the
            // call; the symbol was resolved for this driver's ABI.
            let rc = unsafe {
                match batch {
                    Batch::V1(f) => f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        chunk.len(),
                        &mut attr,
                        attr_idx.as_mut_ptr(),
                        1,
                        &mut fail_idx,
                        s,
                    ),
                    Batch::V2(f) => f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        chunk.len(),
                        &mut attr,
                        attr_idx.as_mut_ptr(),
                        1,
                        s,
                    ),
                    Batch::None => unreachable!("checked above"),
                }
            };
            if rc == CUDA_ERROR_NOT_SUPPORTED && done == 0 {
                // This driver/platform cannot batch: copy one by one, now and from now on.
                BATCH_REFUSED.store(true, Ordering::Relaxed);
                return per_copy(ops, s, enqueued);
            }
            if rc != 0 {
                let at = if fail_idx == usize::MAX {
                    String::new()
                } else {
                    format!(" at copy {}", done + fail_idx)
                };
                return Err(Error::Cuda(format!(
                    "cuMemcpyBatchAsync of {} copies failed{at}: {}",
                    chunk.len(),
                    describe(rc)
                )));
            }
            done += chunk.len();
            *enqueued = true;
        }
        return Ok(());
    }
    per_copy(ops, s, enqueued)
}

fn per_copy(ops: &[CopyOp], s: sys::CUstream, enqueued: &mut bool) -> Result<()> {
    for (i, o) in ops.iter().enumerate() {
        // SAFETY: the plan checked both ranges against their pools; under unified addressing a
        // (pinned) host address is a valid argument in either direction.
        let rc = unsafe { sys::cuMemcpyAsync(o.dst, o.src, o.len as usize, s) };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(Error::Cuda(format!(
                "cuMemcpyAsync (copy {i} of {}) failed: {}",
                ops.len(),
                describe(code(rc))
            )));
        }
        *enqueued = true;
    }
    Ok(())
}

/// Copies GPU-resident index arrays to the host (a blocking read, as SGLang's `.cpu()` is):
/// the copy engine needs host-side addresses to build its list.
fn host_copy(idx: &IndexArray, stream: u64) -> Result<Vec<u8>> {
    may_block()?;
    let bytes = idx.len * idx.width.bytes();
    let mut out = vec![0u8; bytes];
    if bytes > 0 {
        // SAFETY: `out` has `bytes` bytes; the caller keeps the device array alive.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr().cast(),
                    idx.ptr,
                    bytes,
                    as_stream(stream),
                ),
                "cuMemcpyDtoHAsync (indices)",
            )?;
            check(
                sys::cuStreamSynchronize(as_stream(stream)),
                "cuStreamSynchronize",
            )?;
        }
    }
    Ok(out)
}

/// Runs the direct backend's plan for `req` on `stream` (the pointers' context is current).
/// Every host plane must lie in registered memory (`entered`); copies are cut at registration
/// seams. Sets `enqueued` once any copy was queued.
pub(crate) fn run(
    req: &TransferRequest,
    c: &Checked,
    stream: u64,
    driver_version: i32,
    entered: &Entered,
    enqueued: &mut bool,
) -> Result<()> {
    if let Some(p) = entered.registered.iter().position(|&r| !r) {
        let nbytes = c.planes[p].map_or(0, |pl| pl.nbytes);
        return Err(Error::Cuda(format!(
            "the direct backend needs host memory registered with CUDA (pin_memory=True): host \
             plane {p} ({:#x}, {nbytes} bytes) is not, and a copy from pageable memory would \
             block the calling thread until the GPU has finished it; register the pool or use \
             the kernel backend. Nothing was enqueued",
            req.geom.plane_base[p]
        )));
    }
    // Keep the host copies alive until the plan is built.
    let host_buf = req
        .host_idx
        .on_device
        .then(|| host_copy(&req.host_idx, stream))
        .transpose()?;
    let dev_buf = req
        .dev_idx
        .on_device
        .then(|| host_copy(&req.dev_idx, stream))
        .transpose()?;
    let mut local = req.clone();
    let rehome = |idx: &mut IndexArray, buf: &Option<Vec<u8>>| {
        if let Some(b) = buf {
            idx.ptr = b.as_ptr() as u64;
            idx.on_device = false;
        }
    };
    rehome(&mut local.host_idx, &host_buf);
    rehome(&mut local.dev_idx, &dev_buf);
    let ops = plan::build(&local)?;
    if ops.is_empty() {
        return Ok(());
    }
    // A coalesced run may cross a chunk seam once a region is registered in several chunks;
    // the driver rejects a copy whose host range spans two registrations.
    let to_host = req.op.to_host();
    let ops = registry::split_at_seams(ops, to_host, &entered.seams());
    submit(&ops, to_host, stream, driver_version, enqueued)
}
