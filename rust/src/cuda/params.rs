//! The kernels' parameter block (`HkvParams` in rust/kernels/hostkv_transfer.cu) and the one
//! function that fills it from a request, shared by the GPU launch and the CPU emulation so the
//! emulated kernel sees exactly what the real one would.

use crate::error::{Error, Result};
use crate::plan::Checked;
use crate::transfer::{IndexWidth, TransferRequest};

/// Device layer pointers carried inside the parameter block (`HKV_INLINE_PTRS`).
pub(crate) const INLINE_PTRS: usize = 256;
/// Slots of the launch-sequence ring in the error record (`HKV_ABORT_RING`).
pub(crate) const ABORT_RING: usize = 4096;
/// Threads per block of both kernels (32 warps), as SGLang's kernels use.
pub(crate) const BLOCK_THREADS: u32 = 1024;
const WARPS_PER_BLOCK: u64 = BLOCK_THREADS as u64 / 32;
/// Blocks a transfer may occupy unless `HOSTKV_BLOCK_QUOTA` says otherwise: 2 keeps the copy on
/// two SMs so it does not steal the forward pass's SMs (SGLang's default).
pub(crate) const DEFAULT_BLOCK_QUOTA: u32 = 2;

/// `HkvParams`, field for field (`#[repr(C)]`; a test compares sizes and offsets with the C++
/// compiler's).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct HkvParams {
    pub dev_ptrs: [u64; INLINE_PTRS],
    pub dev_table: u64,
    pub host_base: [u64; 2],
    pub item_bytes: [u64; 2],
    pub seg_bytes: [u64; 2],
    pub host_idx: u64,
    pub dev_idx: u64,
    pub n: u64,
    pub host_rows: u64,
    pub dev_rows: u64,
    pub err: u64,
    pub abort_seq: u64,
    pub layers: u32,
    pub layer_begin: u32,
    pub layer_count: u32,
    pub planes: u32,
    pub layout: u32,
    pub to_host: u32,
    pub page_size: u32,
    pub heads: u32,
    pub host_idx_wide: u32,
    pub dev_idx_wide: u32,
}

/// `HkvErrorRecord`.
#[repr(C)]
pub(crate) struct HkvErrorRecord {
    pub flag: u64,
    pub value: u64,
    pub bound: u64,
    pub side: u64,
    pub abort_ring: [u64; ABORT_RING],
}

pub(crate) const SIDE_HOST: u64 = 0;
/// `HkvErrorRecord::flag` once a kernel has filled in the fields (`HKV_FLAG_PUBLISHED`); 1 means
/// claimed and still being written.
pub(crate) const FLAG_PUBLISHED: u64 = 2;

/// Parameters plus what they still need placed in device-visible memory.
pub(crate) struct Marshalled {
    pub params: Box<HkvParams>,
    /// The plane-major device layer table when it does not fit inline (`dev_table` must then
    /// point at a device-visible copy of it).
    pub table: Option<Vec<u64>>,
    /// (index position, plane, layer) copy tasks: zero means there is nothing to launch.
    pub tasks: u64,
}

fn too_big(what: &str, v: u64) -> Error {
    Error::Unsupported(format!(
        "the CUDA kernel path supports {what} up to {}; got {v}",
        u32::MAX
    ))
}

fn to_u32(what: &str, v: u64) -> Result<u32> {
    u32::try_from(v).map_err(|_| too_big(what, v))
}

/// Fills the parameter block for a request that `plan::check_structure`/`validate` accepted.
/// Index addresses, the error record and the abort sequence are left for the caller to place.
pub(crate) fn marshal(req: &TransferRequest, c: &Checked) -> Result<Marshalled> {
    let g = &req.geom;
    // The kernel keeps rows, page sizes and segment lengths in 32-bit registers.
    to_u32("host pool rows", g.rows as u64)?;
    let planes = to_u32("planes", c.nplanes as u64)?;
    let layer_count = to_u32("layers per transfer", c.layer_count)?;
    let nptrs = planes as u64 * layer_count as u64;
    // The copy kernel advances its task counter as (i, r) with r + step < 2 * nptrs in 32 bits.
    if nptrs > i32::MAX as u64 {
        return Err(Error::Unsupported(format!(
            "the CUDA kernel path supports planes x layers up to {}; got {nptrs}",
            i32::MAX
        )));
    }
    let mut params = Box::new(HkvParams {
        dev_ptrs: [0; INLINE_PTRS],
        dev_table: 0,
        host_base: [0; 2],
        item_bytes: [0; 2],
        seg_bytes: [0; 2],
        host_idx: req.host_idx.ptr,
        dev_idx: req.dev_idx.ptr,
        n: c.len as u64,
        host_rows: g.rows as u64,
        dev_rows: req.device.rows as u64,
        err: 0,
        abort_seq: 0,
        layers: to_u32("layers", g.layers as u64)?,
        layer_begin: to_u32("layer id", c.first_layer)?,
        layer_count,
        planes,
        layout: g.layout as u32,
        to_host: u32::from(req.op.to_host()),
        page_size: to_u32("page size", g.page_size as u64)?,
        heads: 1,
        host_idx_wide: u32::from(req.host_idx.width == IndexWidth::I64),
        dev_idx_wide: u32::from(req.dev_idx.width == IndexWidth::I64),
    });
    for p in 0..c.nplanes {
        let pl = c.planes[p].as_ref().ok_or_else(|| {
            Error::Geometry(format!("plane {p} of {} was not checked", c.nplanes))
        })?;
        to_u32("item bytes", pl.item)?;
        params.host_base[p] = g.plane_base[p];
        params.item_bytes[p] = pl.item;
        params.seg_bytes[p] = pl.segment;
        params.heads = to_u32("heads", pl.heads)?;
    }
    let ptrs = &req.device.layer_ptrs;
    let table = if ptrs.len() <= INLINE_PTRS {
        params.dev_ptrs[..ptrs.len()].copy_from_slice(ptrs);
        None
    } else {
        Some(ptrs.clone())
    };
    let tasks = params.n * nptrs;
    Ok(Marshalled {
        params,
        table,
        tasks,
    })
}

/// `HOSTKV_BLOCK_QUOTA` (read on every call so it can be changed at run time), else 2.
pub(crate) fn block_quota() -> Result<u32> {
    match std::env::var("HOSTKV_BLOCK_QUOTA") {
        Err(_) => Ok(DEFAULT_BLOCK_QUOTA),
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(q) if (1..=65_535).contains(&q) => Ok(q),
            _ => Err(Error::Unsupported(format!(
                "HOSTKV_BLOCK_QUOTA must be an integer in [1, 65535], got {v:?}"
            ))),
        },
    }
}

/// Blocks for the copy kernel: enough for one warp per task, at most `quota`.
pub(crate) fn transfer_grid(tasks: u64, quota: u32) -> u32 {
    tasks.div_ceil(WARPS_PER_BLOCK).clamp(1, quota as u64) as u32
}

/// Blocks for the index check kernel: one thread per index position, at most `quota`.
pub(crate) fn check_grid(n: u64, quota: u32) -> u32 {
    n.div_ceil(BLOCK_THREADS as u64).clamp(1, quota as u64) as u32
}

/// The message for a bad index a kernel recorded.
pub(crate) fn bad_index_message(side: u64, value: u64, bound: u64) -> String {
    let which = if side == SIDE_HOST { "host" } else { "device" };
    let v = value as i64;
    if v < 0 {
        format!(
            "{which} index {v} (read by the CUDA kernel from GPU memory) is negative; that \
             transfer wrote nothing"
        )
    } else {
        format!(
            "{which} index {v} (read by the CUDA kernel from GPU memory) is out of range [0, \
             {bound}); that transfer wrote nothing"
        )
    }
}
