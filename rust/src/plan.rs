//! `TransferRequest` -> validated list of byte copies (the CPU engine's input).
//!
//! Everything is checked before a plan is returned, so an engine that runs a plan can never write
//! outside a pool, and a refused request has moved nothing. The same checks are available without
//! building a plan ([`validate`]) for engines that do their own addressing (CUDA, emulation).

use crate::error::{Error, Result};
use crate::layout::PlaneLayout;
use crate::transfer::{Backend, IndexArray, IndexWidth, Layout, Op, TransferRequest};

/// Copy `len` bytes from address `src` to address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// How a (layout, backend) pair moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// One segment per (index, layer, plane, head), as the kernels do.
    PerItem,
    /// Maximal runs where both index streams step by +1 (direct + layer_first).
    Runs,
    /// One `P * I` block per (page, layer, plane), reading the first index of each page
    /// (direct + page_first_direct).
    PageBlocks,
}

pub fn strategy(layout: Layout, backend: Backend) -> Result<Strategy> {
    match (backend, layout) {
        (Backend::Kernel, _) => Ok(Strategy::PerItem),
        (Backend::Direct, Layout::LayerFirst) => Ok(Strategy::Runs),
        (Backend::Direct, Layout::PageFirstDirect) => Ok(Strategy::PageBlocks),
        (Backend::Direct, other) => Err(Error::Unsupported(format!(
            "Unsupported layout: {}",
            other.name()
        ))),
    }
}

/// The request's planes, its strategy and the layers it touches, all checked.
#[derive(Clone, Copy, Debug)]
pub struct Checked {
    pub planes: [Option<PlaneLayout>; 2],
    pub nplanes: usize,
    pub strategy: Strategy,
    /// Host layers `[first, first + count)`; device layer `k` of plane `p` is
    /// `layer_ptrs[p * count + k]` (count is 1 for a load).
    pub first_layer: u64,
    pub layer_count: u64,
    pub len: usize,
}

impl Checked {
    #[inline]
    fn plane(&self, p: usize) -> &PlaneLayout {
        // `planes[..nplanes]` are all `Some` by construction.
        self.planes[p]
            .as_ref()
            .expect("plane checked in check_structure")
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidTransfer(msg)
}

/// Checks that need no index values: geometry, pointer counts, layer id, lengths, page multiple.
pub fn check_structure(req: &TransferRequest) -> Result<Checked> {
    let g = &req.geom;
    let nplanes = g.item_bytes.len();
    if nplanes == 0 || nplanes > 2 || g.plane_base.len() != nplanes {
        return Err(Error::Geometry(format!(
            "a host pool has 1 or 2 planes with one base address each; got {} item sizes and {} \
             base addresses",
            nplanes,
            g.plane_base.len()
        )));
    }
    let mut planes = [None, None];
    for (p, slot) in planes.iter_mut().enumerate().take(nplanes) {
        let pl = PlaneLayout::new(
            g.layout,
            g.layers,
            g.rows,
            g.page_size,
            g.item_bytes[p],
            g.heads,
        )?;
        if g.plane_base[p].checked_add(pl.nbytes).is_none()
            || (g.plane_base[p] == 0 && pl.nbytes > 0)
        {
            return Err(Error::Geometry(format!(
                "plane {p} base address {:#x} cannot hold {} bytes",
                g.plane_base[p], pl.nbytes
            )));
        }
        *slot = Some(pl);
    }
    let strategy = strategy(g.layout, req.backend)?;
    let (first_layer, layer_count) = match req.op {
        Op::Backup => (0, g.layers as u64),
        Op::Load { host_layer } => {
            if host_layer >= g.layers {
                return Err(invalid(format!(
                    "host layer {host_layer} is out of range [0, {})",
                    g.layers
                )));
            }
            (host_layer as u64, 1)
        }
    };
    let want_ptrs = nplanes as u64 * layer_count;
    if req.device.layer_ptrs.len() as u64 != want_ptrs {
        return Err(invalid(format!(
            "expected {want_ptrs} device layer pointers ({nplanes} plane(s) x {layer_count} \
             layer(s)), got {}",
            req.device.layer_ptrs.len()
        )));
    }
    let (h, d) = (&req.host_idx, &req.dev_idx);
    if h.len != d.len {
        return Err(invalid(
            "Source and destination indices must have the same length".into(),
        ));
    }
    let len = h.len;
    if strategy == Strategy::PageBlocks && len as u64 % g.page_size as u64 != 0 {
        return Err(invalid(
            "Source indices size must be divisible by page size".into(),
        ));
    }
    if len > 0 {
        for (p, &item) in g.item_bytes.iter().enumerate() {
            let span = (req.device.rows as u64).checked_mul(item as u64);
            let ptrs = &req.device.layer_ptrs[p * layer_count as usize..][..layer_count as usize];
            for &ptr in ptrs {
                if ptr == 0 || span.and_then(|s| ptr.checked_add(s)).is_none() {
                    return Err(invalid(format!(
                        "device layer pointer {ptr:#x} cannot address {} rows of {item} bytes",
                        req.device.rows
                    )));
                }
            }
        }
        for (which, idx) in [("host", h), ("device", d)] {
            if idx.ptr == 0 {
                return Err(invalid(format!("{which} index array has a null address")));
            }
            if idx
                .ptr
                .checked_add(len as u64 * idx.width.bytes() as u64)
                .is_none()
            {
                return Err(invalid(format!(
                    "{which} index array address {:#x} is invalid",
                    idx.ptr
                )));
            }
        }
    }
    Ok(Checked {
        planes,
        nplanes,
        strategy,
        first_layer,
        layer_count,
        len,
    })
}

/// Reads and bounds-checks one index array: every value in `[0, bound)`.
fn read_indices(which: &str, idx: &IndexArray, bound: u64) -> Result<Vec<u64>> {
    if idx.on_device {
        return Err(invalid(format!(
            "{which} indices are in GPU memory; the CPU engine needs CPU index tensors"
        )));
    }
    let mut out = Vec::with_capacity(idx.len);
    // SAFETY: the caller guarantees `len` contiguous elements of `width` at `ptr` (checked
    // non-null), alive for the call. Reads are unaligned-safe because nothing promised alignment.
    unsafe {
        match idx.width {
            IndexWidth::I32 => {
                let base = idx.ptr as *const i32;
                for i in 0..idx.len {
                    out.push(base.add(i).read_unaligned() as i64);
                }
            }
            IndexWidth::I64 => {
                let base = idx.ptr as *const i64;
                for i in 0..idx.len {
                    out.push(base.add(i).read_unaligned());
                }
            }
        }
    }
    // Validate in a second pass so the hot read loop stays branch-light.
    let mut bad = None;
    for (i, &v) in out.iter().enumerate() {
        if v < 0 || v as u64 >= bound {
            bad = Some((i, v));
            break;
        }
    }
    if let Some((i, v)) = bad {
        return Err(invalid(if v < 0 {
            format!("{which} index {v} at position {i} is negative")
        } else {
            format!("{which} index {v} at position {i} is out of range [0, {bound})")
        }));
    }
    // All values are non-negative: reinterpreting the vector as u64 keeps every value.
    Ok(out.into_iter().map(|v| v as u64).collect())
}

/// The validated index values of a request (host slots, device rows).
pub struct Indices {
    pub host: Vec<u64>,
    pub dev: Vec<u64>,
}

fn read_all(req: &TransferRequest, c: &Checked) -> Result<Indices> {
    let host = read_indices("host", &req.host_idx, req.geom.rows as u64)?;
    let dev = read_indices("device", &req.dev_idx, req.device.rows as u64)?;
    if c.strategy == Strategy::PageBlocks {
        let p = req.geom.page_size as u64;
        for (k, &d) in dev.iter().step_by(p as usize).enumerate() {
            if d + p > req.device.rows as u64 {
                return Err(invalid(format!(
                    "device page starting at index {d} (position {}) needs rows [{d}, {}) but the \
                     device pool has {} rows",
                    k as u64 * p,
                    d + p,
                    req.device.rows
                )));
            }
        }
    }
    Ok(Indices { host, dev })
}

/// Runs every check, reading host-resident indices; device-resident indices are left to the
/// kernel (which checks them itself). Nothing is copied.
pub fn validate(req: &TransferRequest) -> Result<Checked> {
    let c = check_structure(req)?;
    if c.len > 0 && !req.host_idx.on_device && !req.dev_idx.on_device {
        read_all(req, &c)?;
    } else if c.len > 0 {
        // Mixed residency: check the side we can read.
        if !req.host_idx.on_device {
            read_indices("host", &req.host_idx, req.geom.rows as u64)?;
        }
        if !req.dev_idx.on_device {
            read_indices("device", &req.dev_idx, req.device.rows as u64)?;
        }
    }
    Ok(c)
}

/// Appends ops, merging one into the previous when both sides continue it exactly (the bytes
/// moved are the same; fewer, longer copies are faster).
struct OpSink {
    ops: Vec<CopyOp>,
}

impl OpSink {
    #[inline(always)]
    fn push(&mut self, src: u64, dst: u64, len: u64) {
        if let Some(last) = self.ops.last_mut() {
            if last.src + last.len == src && last.dst + last.len == dst {
                last.len += len;
                return;
            }
        }
        self.ops.push(CopyOp { src, dst, len });
    }
}

/// Validates `req` and returns the copies that carry it out on the CPU. Backup copies device ->
/// host for every layer; load copies one host layer into one device layer.
pub fn build(req: &TransferRequest) -> Result<Vec<CopyOp>> {
    let c = check_structure(req)?;
    if req.host_idx.on_device || req.dev_idx.on_device {
        return Err(invalid(
            "indices are in GPU memory; the CPU engine needs CPU index tensors".into(),
        ));
    }
    if c.len == 0 {
        return Ok(Vec::new());
    }
    let idx = read_all(req, &c)?;
    let backup = matches!(req.op, Op::Backup);
    let ptrs = &req.device.layer_ptrs;
    let lc = c.layer_count as usize;

    let sink = match c.strategy {
        Strategy::PerItem => {
            let heads = c.plane(0).heads;
            let cap = c.nplanes * lc * c.len * heads as usize;
            let mut sink = OpSink {
                ops: Vec::with_capacity(cap.min(1 << 20)),
            };
            for p in 0..c.nplanes {
                let pl = *c.plane(p);
                let base = req.geom.plane_base[p];
                for k in 0..lc {
                    let layer = c.first_layer + k as u64;
                    let dev_base = ptrs[p * lc + k];
                    for (&t, &d) in idx.host.iter().zip(&idx.dev) {
                        for h in 0..heads {
                            let host = base + pl.offset_unchecked(t, layer, h);
                            let dev = dev_base + d * pl.item + h * pl.segment;
                            if backup {
                                sink.push(dev, host, pl.segment);
                            } else {
                                sink.push(host, dev, pl.segment);
                            }
                        }
                    }
                }
            }
            sink
        }
        Strategy::Runs => {
            let runs = runs(&idx.host, &idx.dev);
            let mut sink = OpSink {
                ops: Vec::with_capacity(c.nplanes * lc * runs.len()),
            };
            for p in 0..c.nplanes {
                let pl = *c.plane(p);
                let base = req.geom.plane_base[p];
                for k in 0..lc {
                    let layer = c.first_layer + k as u64;
                    let dev_base = ptrs[p * lc + k];
                    for &(t, d, n) in &runs {
                        let host = base + pl.offset_unchecked(t, layer, 0);
                        let dev = dev_base + d * pl.item;
                        if backup {
                            sink.push(dev, host, n * pl.item);
                        } else {
                            sink.push(host, dev, n * pl.item);
                        }
                    }
                }
            }
            sink
        }
        Strategy::PageBlocks => {
            let ps = req.geom.page_size;
            let pages = c.len / ps;
            let mut sink = OpSink {
                ops: Vec::with_capacity(c.nplanes * lc * pages),
            };
            for p in 0..c.nplanes {
                let pl = *c.plane(p);
                let base = req.geom.plane_base[p];
                let block = pl.page_size * pl.item;
                for k in 0..lc {
                    let layer = c.first_layer + k as u64;
                    let dev_base = ptrs[p * lc + k];
                    for i in 0..pages {
                        let t = idx.host[i * ps];
                        let d = idx.dev[i * ps];
                        let host = base + pl.page_block_offset(t / pl.page_size, layer);
                        let dev = dev_base + d * pl.item;
                        if backup {
                            sink.push(dev, host, block);
                        } else {
                            sink.push(host, dev, block);
                        }
                    }
                }
            }
            sink
        }
    };
    Ok(sink.ops)
}

/// Maximal runs `(host_start, dev_start, count)` where both streams step by +1.
fn runs(host: &[u64], dev: &[u64]) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < host.len() {
        let mut j = i + 1;
        while j < host.len() && host[j] == host[j - 1] + 1 && dev[j] == dev[j - 1] + 1 {
            j += 1;
        }
        out.push((host[i], dev[i], (j - i) as u64));
        i = j;
    }
    out
}

/// Bytes a plan moves.
pub fn total_bytes(ops: &[CopyOp]) -> u64 {
    ops.iter().map(|o| o.len).sum()
}
