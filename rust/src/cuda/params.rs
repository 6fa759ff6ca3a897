//! The kernels' parameter block (`HkvParams` in rust/kernels/hostkv_transfer.cu) and the one
//! function that fills it from a request, shared by the GPU launch and the CPU emulation so the
//! emulated kernel sees exactly what the real one would.

use crate::error::{Error, Result};
use crate::index_map::MapParams;
use crate::plan::Checked;
use crate::request::{IndexWidth, TransferRequest};

/// Device layer pointers carried inside the parameter block (`HKV_INLINE_PTRS`).
pub(crate) const INLINE_PTRS: usize = 256;
/// Slots of the launch-sequence ring in the error record (`HKV_ABORT_RING`).
pub(crate) const ABORT_RING: usize = 4096;
/// Threads per block of both kernels (8 warps; `HKV_BLOCK`). The kernels are compiled for 4 such
/// blocks per SM (`__launch_bounds__(256, 4)`, at most 64 registers per thread), so a copy block
/// takes a quarter of an SM and never waits for, or holds, a whole one.
pub(crate) const BLOCK_THREADS: u32 = 256;
const WARPS_PER_BLOCK: u64 = BLOCK_THREADS as u64 / 32;
/// `HOSTKV_BLOCK_QUOTA` counts warps' worth of work in units of SGLang's 1024-thread block (32
/// warps): quota `q` allows `q * 4` of our 256-thread blocks, the same warp count as SGLang's `q`
/// blocks.
pub(crate) const BLOCKS_PER_QUOTA: u32 = 1024 / BLOCK_THREADS;

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
    pub dev_pitch: [u64; 2],
    pub host_idx: u64,
    pub dev_idx: u64,
    pub n: u64,
    pub host_rows: u64,
    pub dev_rows: u64,
    pub err: u64,
    pub dev_err: u64,
    pub abort_seq: u64,
    /// `HkvIndexMap` in C: [`MapParams`] is `#[repr(C)]` with the same fields.
    pub host_map: MapParams,
    pub dev_map: MapParams,
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

/// `HkvErrorRecord`: pinned, device-mapped host memory the host reads without synchronising.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct HkvErrorRecord {
    /// Generation of the last published record (0: none yet).
    pub flag: u64,
    pub value: u64,
    pub bound: u64,
    pub side: u64,
    /// Launches refused so far (mirror of `HkvDeviceRecord::aborted`).
    pub aborted: u64,
    /// Written by the host: the generation it last reported.
    pub ack: u64,
}

/// `HkvDeviceRecord`: device memory, touched only by device-scope atomics.
#[repr(C)]
pub(crate) struct HkvDeviceRecord {
    pub claim: u64,
    pub aborted: u64,
    pub abort_ring: [u64; ABORT_RING],
}

pub(crate) const SIDE_HOST: u64 = 0;
/// A broken page run (`HKV_SIDE_HOST_RUN` / `HKV_SIDE_DEVICE_RUN`): the record's value is the
/// raw position, its bound the page size.
pub(crate) const SIDE_HOST_RUN: u64 = 2;
pub(crate) const SIDE_DEVICE_RUN: u64 = 3;

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
    Error::unsupported(format!(
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
    let g = req.geom();
    // The kernel keeps rows, page sizes and segment lengths in 32-bit registers.
    to_u32("host pool rows", g.rows as u64)?;
    let planes = to_u32("planes", c.nplanes as u64)?;
    let layer_count = to_u32("layers per transfer", c.layer_count)?;
    let nptrs = planes as u64 * layer_count as u64;
    // The copy kernel advances its task counter as (i, r) with r + step < 2 * nptrs in 32 bits.
    if nptrs > i32::MAX as u64 {
        return Err(Error::unsupported(format!(
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
        dev_pitch: [0; 2],
        host_idx: req.host_idx().ptr,
        dev_idx: req.dev_idx().ptr,
        n: c.len as u64,
        host_rows: g.rows as u64,
        dev_rows: req.device().rows as u64,
        err: 0,
        dev_err: 0,
        abort_seq: 0,
        host_map: req.host_idx().map.params(),
        dev_map: req.dev_idx().map.params(),
        layers: to_u32("layers", g.layers as u64)?,
        layer_begin: to_u32("layer id", c.first_layer)?,
        layer_count,
        planes,
        layout: g.layout as u32,
        to_host: u32::from(req.op().to_host()),
        page_size: to_u32("page size", g.page_size as u64)?,
        heads: 1,
        host_idx_wide: u32::from(req.host_idx().width == IndexWidth::I64),
        dev_idx_wide: u32::from(req.dev_idx().width == IndexWidth::I64),
    });
    for p in 0..c.nplanes {
        let pl = c.planes[p].as_ref().ok_or_else(|| {
            Error::geometry(format!("plane {p} of {} was not checked", c.nplanes))
        })?;
        to_u32("item bytes", pl.item)?;
        params.host_base[p] = g.plane_base[p];
        params.item_bytes[p] = pl.item;
        params.seg_bytes[p] = pl.segment;
        params.dev_pitch[p] = c.dev_pitch[p];
        params.heads = to_u32("heads", pl.heads)?;
    }
    let ptrs = &req.device().layer_ptrs;
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

fn max_blocks(quota: u32) -> u64 {
    quota as u64 * BLOCKS_PER_QUOTA as u64
}

/// Blocks for the copy kernel: enough for one warp per task, at most `quota * 4` (see
/// `BLOCKS_PER_QUOTA`).
pub(crate) fn transfer_grid(tasks: u64, quota: u32) -> u32 {
    tasks.div_ceil(WARPS_PER_BLOCK).clamp(1, max_blocks(quota)) as u32
}

/// Blocks for the index check kernel: one thread per index position, at most `quota * 4`.
pub(crate) fn check_grid(n: u64, quota: u32) -> u32 {
    n.div_ceil(BLOCK_THREADS as u64).clamp(1, max_blocks(quota)) as u32
}

/// The message for bad device-resident indices the kernels recorded: the published record's
/// details (`None`: not recorded, see `error_record`) and how many launches were refused since
/// the last report.
pub(crate) fn refused_message(detail: Option<(u64, u64, u64)>, refused: u64) -> String {
    match detail {
        Some((side, value, bound)) if refused <= 1 => bad_index_message(side, value, bound),
        Some((side, value, bound)) => format!(
            "{}; {refused} CUDA transfers were refused for bad GPU-resident indices since the \
             last report (none of them wrote anything); this is the first recorded",
            bad_index_message(side, value, bound)
        ),
        None => format!(
            "{refused} CUDA transfer(s) were refused for bad GPU-resident indices (negative or out \
             of range) since the last report; none of them wrote anything (their details were \
             not recorded: an earlier report was still pending)"
        ),
    }
}

/// The message for a bad index a kernel recorded.
pub(crate) fn bad_index_message(side: u64, value: u64, bound: u64) -> String {
    let which = if side == SIDE_HOST || side == SIDE_HOST_RUN {
        "host"
    } else {
        "device"
    };
    if side == SIDE_HOST_RUN || side == SIDE_DEVICE_RUN {
        return format!(
            "{which} index at position {value} (read by the CUDA kernel from GPU memory) breaks \
             its page: page-row transfers take whole pages of {bound} consecutive slots starting \
             on a page boundary; that transfer wrote nothing"
        );
    }
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
