//! The direct backend on a GPU: the validated plan (coalesced runs, or `P * I` page blocks) goes
//! to the copy engine in `cuMemcpyBatchAsync` batches where the driver has it, else one
//! `cuMemcpyAsync` per copy. The plan is walked once, copy by copy: a batch is submitted each
//! time it fills up, so the (src, dst, len) arrays stay bounded whatever the transfer's size.
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
use crate::plan::{self, Checked, CopyOp, IndexView, Side};
use crate::request::TransferRequest;

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
        // SAFETY: `symbol` needs the real C signature of the named symbol: `BatchV2` is
        // `cuMemcpyBatchAsync_v2` of CUDA 13.x and `BatchV1` is `cuMemcpyBatchAsync` of 12.8/12.9,
        // each looked up only for a driver of that version.
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

/// Whether to submit batches: not after the driver refused one, nor under `HOSTKV_DIRECT_BATCH=0`.
fn batch_enabled() -> Result<bool> {
    // The variable first, so a bad value is refused even after the driver refused a batch.
    let asked = crate::config::direct_batch()?;
    Ok(asked && !BATCH_REFUSED.load(Ordering::Relaxed))
}

const CUDA_ERROR_NOT_SUPPORTED: c_int = 801;
/// Copies per batch call at most; bounds the arrays of one submission (24 bytes per copy).
const MAX_BATCH: usize = 1 << 16;
/// Copies per batch call at least (6 KiB of arrays), however small the transfer.
const MIN_BATCH: usize = 256;
/// A batch's arrays stay under 1% of the bytes the transfer moves (above `MIN_BATCH`).
const BATCH_BYTES_PER_COPY: u64 = 100 * 24;

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

/// Streams copies to the driver on one stream: batches of up to `cap` copies through
/// `cuMemcpyBatchAsync` where the driver has it, else (or after CUDA_ERROR_NOT_SUPPORTED) one
/// `cuMemcpyAsync` per copy. Sets `enqueued` once any copy was queued.
struct Submitter<'e> {
    stream: sys::CUstream,
    /// `Batch::None`: copy one by one.
    batch: Batch,
    attr: sys::CUmemcpyAttributes,
    cap: usize,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    /// Copies queued so far (batch positions in errors count from here).
    done: usize,
    enqueued: &'e mut bool,
}

impl<'e> Submitter<'e> {
    /// `to_host` says which side each copy's destination is; `bytes` is what the transfer moves.
    fn new(
        to_host: bool,
        stream: u64,
        driver_version: i32,
        bytes: u64,
        enqueued: &'e mut bool,
    ) -> Result<Self> {
        // The legacy NULL stream (0, or CU_STREAM_LEGACY = 1) is rejected by the batch API.
        let legacy = stream <= 1;
        // Read before the stream test, so a bad value is refused on every stream.
        let enabled = batch_enabled()?;
        let batch = if legacy || !enabled {
            Batch::None
        } else {
            batch_fn(driver_version)
        };
        let ordinal = if matches!(batch, Batch::None) {
            0
        } else {
            probe::current_device()?
        };
        let cap = usize::try_from(bytes / BATCH_BYTES_PER_COPY)
            .unwrap_or(MAX_BATCH)
            .clamp(MIN_BATCH, MAX_BATCH);
        Ok(Self {
            stream: as_stream(stream),
            batch,
            attr: sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: location(!to_host, ordinal),
                dstLocHint: location(to_host, ordinal),
                flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
            },
            cap,
            dsts: Vec::new(),
            srcs: Vec::new(),
            sizes: Vec::new(),
            done: 0,
            enqueued,
        })
    }

    fn push(&mut self, op: CopyOp) -> Result<()> {
        if matches!(self.batch, Batch::None) {
            return self.one(op);
        }
        self.dsts.push(op.dst);
        self.srcs.push(op.src);
        self.sizes.push(op.len as usize);
        if self.dsts.len() >= self.cap {
            self.flush()?;
        }
        Ok(())
    }

    /// One `cuMemcpyAsync`.
    fn one(&mut self, op: CopyOp) -> Result<()> {
        // SAFETY: a copy of the plan, inside one host plane and one device layer of a request
        // whose constructor made both valid for CUDA until the enqueued work has finished (the
        // host plane is registered, checked by `run`); under unified addressing a pinned host
        // address is a valid argument in either direction.
        let rc = unsafe { sys::cuMemcpyAsync(op.dst, op.src, op.len as usize, self.stream) };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(Error::cuda(format!(
                "cuMemcpyAsync (copy {}) failed: {}",
                self.done,
                describe(code(rc))
            )));
        }
        self.done += 1;
        *self.enqueued = true;
        Ok(())
    }

    /// Submits the copies collected so far as one batch.
    fn flush(&mut self) -> Result<()> {
        let n = self.dsts.len();
        if n == 0 {
            return Ok(());
        }
        let mut attr_idx = [0usize];
        let mut fail_idx = usize::MAX;
        let (dsts, srcs, sizes) = (
            self.dsts.as_mut_ptr(),
            self.srcs.as_mut_ptr(),
            self.sizes.as_mut_ptr(),
        );
        // SAFETY: three arrays of `n` entries and one attribute record, alive (and not moved)
        // for the call, which reads them before returning; the symbol was resolved for this
        // driver's ABI. The copies themselves come from the plan, as in `one`.
        let rc = unsafe {
            match self.batch {
                Batch::V1(f) => f(
                    dsts,
                    srcs,
                    sizes,
                    n,
                    &mut self.attr,
                    attr_idx.as_mut_ptr(),
                    1,
                    &mut fail_idx,
                    self.stream,
                ),
                Batch::V2(f) => f(
                    dsts,
                    srcs,
                    sizes,
                    n,
                    &mut self.attr,
                    attr_idx.as_mut_ptr(),
                    1,
                    self.stream,
                ),
                Batch::None => unreachable!("only batches are flushed"),
            }
        };
        if rc == CUDA_ERROR_NOT_SUPPORTED && self.done == 0 {
            // This driver/platform cannot batch: copy one by one, now and from now on.
            BATCH_REFUSED.store(true, Ordering::Relaxed);
            self.batch = Batch::None;
            let pending: Vec<CopyOp> = (0..n)
                .map(|i| CopyOp {
                    src: self.srcs[i],
                    dst: self.dsts[i],
                    len: self.sizes[i] as u64,
                })
                .collect();
            self.clear();
            return pending.into_iter().try_for_each(|op| self.one(op));
        }
        if rc != 0 {
            let at = if fail_idx == usize::MAX {
                String::new()
            } else {
                format!(" at copy {}", self.done + fail_idx)
            };
            return Err(Error::cuda(format!(
                "cuMemcpyBatchAsync of {n} copies failed{at}: {}",
                describe(rc)
            )));
        }
        self.done += n;
        *self.enqueued = true;
        self.clear();
        Ok(())
    }

    fn clear(&mut self) {
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
    }
}

/// Copies the request's GPU-resident index array `side` to the host (a blocking read, as
/// SGLang's `.cpu()` is): the copy engine needs host-side addresses to build its list. `None`
/// for a host-resident array.
fn host_copy(req: &TransferRequest, side: Side, stream: u64) -> Result<Option<Vec<u8>>> {
    let idx = match side {
        Side::Host => req.host_idx(),
        Side::Device => req.dev_idx(),
    };
    if !idx.on_device {
        return Ok(None);
    }
    may_block()?;
    let bytes = idx.len * idx.width.bytes();
    let mut out = vec![0u8; bytes];
    if bytes > 0 {
        check(
            // SAFETY: `out` has `bytes` writable bytes; the request's constructor keeps the
            // device array (`len * width` bytes of GPU memory) alive and unchanged for the call.
            // `out` is read or freed only after the stream was synchronised (below).
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr().cast(),
                    idx.ptr,
                    bytes,
                    as_stream(stream),
                )
            },
            "cuMemcpyDtoHAsync (indices)",
        )?;
        let synced = check(
            // SAFETY: the caller's stream, in the current context.
            unsafe { sys::cuStreamSynchronize(as_stream(stream)) },
            "cuStreamSynchronize",
        );
        if let Err(e) = synced {
            // The copy into `out` may still be pending: never free memory a DMA may write.
            std::mem::forget(out);
            return Err(e);
        }
    }
    Ok(Some(out))
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
        return Err(Error::cuda(format!(
            "the direct backend needs host memory registered with CUDA (pin_memory=True): host \
             plane {p} ({:#x}, {nbytes} bytes) is not, and a copy from pageable memory would \
             block the calling thread until the GPU has finished it; register the pool or use \
             the kernel backend. Nothing was enqueued",
            req.geom().plane_base[p]
        )));
    }
    // Host copies of GPU-resident arrays, alive until the plan has been walked.
    let host_buf = host_copy(req, Side::Host, stream)?;
    let dev_buf = host_copy(req, Side::Device, stream)?;
    let plan = match (&host_buf, &dev_buf) {
        (None, None) => plan::build(req)?,
        _ => {
            let h = match &host_buf {
                Some(b) => {
                    IndexView::from_bytes(b, req.host_idx().width).with_map(req.host_idx().map)?
                }
                // Host-resident: the request's own array, as `plan::build` reads it.
                None => plan::index_view(req, Side::Host)?,
            };
            let d = match &dev_buf {
                Some(b) => {
                    IndexView::from_bytes(b, req.dev_idx().width).with_map(req.dev_idx().map)?
                }
                None => plan::index_view(req, Side::Device)?,
            };
            plan::build_with(req, h, d)?
        }
    };
    if plan.is_empty() {
        return Ok(());
    }
    // A coalesced run may cross a chunk seam once a region is registered in several chunks;
    // the driver rejects a copy whose host range spans two registrations.
    let to_host = plan.to_host();
    let seams = entered.seams();
    let mut sub = Submitter::new(to_host, stream, driver_version, plan.bytes(), enqueued)?;
    plan.for_each_copy(0..plan.units(), |op| {
        registry::split_at_seams(op, to_host, &seams, |piece| sub.push(piece))
    })?;
    sub.flush()
}
