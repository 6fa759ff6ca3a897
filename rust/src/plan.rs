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
        Op::BackupLayer { host_layer } | Op::Load { host_layer } => {
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
    // SGLang's direct ops (transfer_kv_direct and the page-first-direct pair) all refuse a
    // partial page; its kernels do not check.
    if strategy != Strategy::PerItem && len as u64 % g.page_size as u64 != 0 {
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
            let span = (len as u64).checked_mul(idx.width.bytes() as u64);
            if span.is_none_or(|n| n > isize::MAX as u64 || idx.ptr.checked_add(n).is_none()) {
                return Err(invalid(format!(
                    "{which} index array of {len} elements at {:#x} is not addressable",
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
        check_page_runs(&host, &dev, p)?;
    }
    Ok(Indices { host, dev })
}

/// A page-block copy moves whole pages: `P` host slots starting at a page boundary and `P`
/// consecutive device rows, found from the first index of each page. Refuse any page whose
/// indices say otherwise, or the copy would move rows that were not listed.
fn check_page_runs(host: &[u64], dev: &[u64], p: u64) -> Result<()> {
    for (k, (h, d)) in host
        .chunks(p as usize)
        .zip(dev.chunks(p as usize))
        .enumerate()
    {
        let first = k as u64 * p;
        if h[0] % p != 0 {
            return Err(invalid(format!(
                "page {k}: host index {} at position {first} does not start a page (page size \
                 {p}); page-block copies move whole host pages",
                h[0]
            )));
        }
        for (side, run) in [("host", h), ("device", d)] {
            if let Some(j) = (1..run.len()).find(|&j| run[j] != run[0] + j as u64) {
                return Err(invalid(format!(
                    "page {k}: {side} index {} at position {} breaks the run {}..{} (page-block \
                     copies move {p} consecutive rows per page)",
                    run[j],
                    first + j as u64,
                    run[0],
                    run[0] + p
                )));
            }
        }
    }
    Ok(())
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
    let backup = req.op.to_host();
    let ptrs = &req.device.layer_ptrs;
    let lc = c.layer_count as usize;

    let sink = match c.strategy {
        Strategy::PerItem => {
            let heads = c.plane(0).heads;
            let cap = (c.nplanes * lc)
                .saturating_mul(c.len)
                .saturating_mul(heads as usize);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::{DeviceSide, HostGeometry};

    /// xorshift: deterministic test data without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn shuffle<T>(&mut self, v: &mut [T]) {
            for i in (1..v.len()).rev() {
                v.swap(i, self.below(i as u64 + 1) as usize);
            }
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    #[derive(Clone, Debug)]
    struct Case {
        layout: Layout,
        backend: Backend,
        layers: usize,
        rows: usize,
        page: usize,
        heads: usize,
        items: Vec<usize>,
        dev_rows: usize,
        host_idx: Vec<i64>,
        dev_idx: Vec<i64>,
        width: IndexWidth,
        op: Op,
    }

    struct World {
        host: Vec<Vec<u8>>,
        /// `[plane][layer]` device layers (all host layers for backup, one for load).
        dev: Vec<Vec<Vec<u8>>>,
    }

    impl Case {
        fn device_layers(&self) -> usize {
            match self.op {
                Op::Backup => self.layers,
                Op::BackupLayer { .. } | Op::Load { .. } => 1,
            }
        }

        fn world(&self, rng: &mut Rng) -> World {
            World {
                host: self
                    .items
                    .iter()
                    .map(|&i| rng.bytes(self.layers * self.rows * i))
                    .collect(),
                dev: self
                    .items
                    .iter()
                    .map(|&i| {
                        (0..self.device_layers())
                            .map(|_| rng.bytes(self.dev_rows * i))
                            .collect()
                    })
                    .collect(),
            }
        }

        fn encode(v: &[i64], w: IndexWidth) -> Vec<u8> {
            match w {
                IndexWidth::I32 => v.iter().flat_map(|&x| (x as i32).to_ne_bytes()).collect(),
                IndexWidth::I64 => v.iter().flat_map(|&x| x.to_ne_bytes()).collect(),
            }
        }

        /// Builds the request over `world`; the returned buffers back the index arrays.
        fn request(&self, world: &mut World) -> (TransferRequest, Vec<u8>, Vec<u8>) {
            let hb = Self::encode(&self.host_idx, self.width);
            let db = Self::encode(&self.dev_idx, self.width);
            let layer_ptrs = world
                .dev
                .iter_mut()
                .flat_map(|layers| layers.iter_mut().map(|l| l.as_mut_ptr() as u64))
                .collect();
            let req = TransferRequest {
                geom: HostGeometry {
                    layout: self.layout,
                    layers: self.layers,
                    rows: self.rows,
                    page_size: self.page,
                    heads: self.heads,
                    item_bytes: self.items.clone(),
                    plane_base: world
                        .host
                        .iter_mut()
                        .map(|h| h.as_mut_ptr() as u64)
                        .collect(),
                },
                backend: self.backend,
                op: self.op,
                device: DeviceSide {
                    layer_ptrs,
                    rows: self.dev_rows,
                },
                host_idx: IndexArray {
                    ptr: hb.as_ptr() as u64,
                    len: self.host_idx.len(),
                    width: self.width,
                    on_device: false,
                },
                dev_idx: IndexArray {
                    ptr: db.as_ptr() as u64,
                    len: self.dev_idx.len(),
                    width: self.width,
                    on_device: false,
                },
            };
            (req, hb, db)
        }

        /// Host byte offset from the contract's formulas (host-pool-contract §2.1).
        fn host_off(&self, item: usize, t: usize, l: usize, h: usize) -> usize {
            let (ll, s, p, hh) = (self.layers, self.rows, self.page, self.heads);
            let ld = ll * item;
            match self.layout {
                Layout::LayerFirst => l * s * item + t * item,
                Layout::PageFirst => t * ld + l * item,
                Layout::PageFirstDirect => (t / p) * p * ld + l * p * item + (t % p) * item,
                Layout::PageHead => {
                    (t / p) * p * ld + h * p * (ld / hh) + (t % p) * (ld / hh) + l * (item / hh)
                }
            }
        }

        /// What the transfer must do, byte by byte, written from transfer-semantics §2.6 / §3.
        fn reference(&self, w: &mut World) {
            let (first, count) = match self.op {
                Op::Backup => (0, self.layers),
                Op::BackupLayer { host_layer } | Op::Load { host_layer } => (host_layer, 1),
            };
            let heads = if self.layout == Layout::PageHead {
                self.heads
            } else {
                1
            };
            // (host row, device row) pairs actually moved.
            let pairs: Vec<(usize, usize)> =
                if self.backend == Backend::Direct && self.layout == Layout::PageFirstDirect {
                    let p = self.page;
                    (0..self.host_idx.len() / p)
                        .flat_map(|k| {
                            let hp = self.host_idx[k * p] as usize / p;
                            let d = self.dev_idx[k * p] as usize;
                            (0..p).map(move |r| (hp * p + r, d + r))
                        })
                        .collect()
                } else {
                    self.host_idx
                        .iter()
                        .zip(&self.dev_idx)
                        .map(|(&a, &b)| (a as usize, b as usize))
                        .collect()
                };
            for (pl, &item) in self.items.iter().enumerate() {
                let seg = item / heads;
                for k in 0..count {
                    let l = first + k;
                    for &(t, d) in &pairs {
                        for h in 0..heads {
                            let ho = self.host_off(item, t, l, h);
                            let dof = d * item + h * seg;
                            let host = &mut w.host[pl][ho..ho + seg];
                            let dev = &mut w.dev[pl][k][dof..dof + seg];
                            if self.op.to_host() {
                                host.copy_from_slice(dev);
                            } else {
                                dev.copy_from_slice(host);
                            }
                        }
                    }
                }
            }
        }

        fn run_plan(&self, w: &mut World) -> Result<Vec<CopyOp>> {
            let (req, _hb, _db) = self.request(w);
            let ops = build(&req)?;
            unsafe { crate::cpu::execute(&ops) };
            Ok(ops)
        }

        /// Runs the plan and the reference on identical worlds and compares every byte.
        fn check(&self, seed: u64) -> Vec<CopyOp> {
            let mut rng = Rng(seed | 1);
            let mut got = self.world(&mut rng);
            let mut rng = Rng(seed | 1);
            let mut want = self.world(&mut rng);
            let ops = self
                .run_plan(&mut got)
                .unwrap_or_else(|e| panic!("{self:?}: {e}"));
            self.reference(&mut want);
            assert!(got.host == want.host, "host bytes differ: {self:?}");
            assert!(got.dev == want.dev, "device bytes differ: {self:?}");
            ops
        }
    }

    /// Whole pages of distinct host and device slots, in random page order.
    fn paged_indices(
        rng: &mut Rng,
        rows: usize,
        dev_rows: usize,
        page: usize,
        npages: usize,
    ) -> (Vec<i64>, Vec<i64>) {
        let mut hp: Vec<usize> = (0..rows / page).collect();
        let mut dp: Vec<usize> = (0..dev_rows / page).collect();
        rng.shuffle(&mut hp);
        rng.shuffle(&mut dp);
        let mut h = Vec::new();
        let mut d = Vec::new();
        for k in 0..npages {
            for r in 0..page {
                h.push((hp[k] * page + r) as i64);
                d.push((dp[k] * page + r) as i64);
            }
        }
        (h, d)
    }

    fn base_case(layout: Layout, backend: Backend, items: Vec<usize>) -> Case {
        Case {
            layout,
            backend,
            layers: 3,
            rows: 16,
            page: 4,
            heads: 1,
            items,
            dev_rows: 12,
            host_idx: vec![],
            dev_idx: vec![],
            width: IndexWidth::I64,
            op: Op::Backup,
        }
    }

    const PAIRS: [(Layout, Backend); 6] = [
        (Layout::LayerFirst, Backend::Kernel),
        (Layout::PageFirst, Backend::Kernel),
        (Layout::PageHead, Backend::Kernel),
        (Layout::PageFirstDirect, Backend::Kernel),
        (Layout::LayerFirst, Backend::Direct),
        (Layout::PageFirstDirect, Backend::Direct),
    ];

    #[test]
    fn randomized_transfers_match_the_reference() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        let geoms: &[(usize, usize, &[usize], usize)] = &[
            // (layers, page, items, heads)
            (7, 4, &[12, 12], 2),
            (61, 1, &[3], 1),
            (2, 8, &[1], 1),
            (5, 2, &[656], 2),
            (3, 4, &[256, 192], 4),
            (1, 16, &[1152], 8),
            (4, 3, &[24, 8], 2),
        ];
        let mut cases = 0;
        for &(layout, backend) in &PAIRS {
            for &(layers, page, items, heads) in geoms {
                if layout == Layout::PageHead && items.iter().any(|i| i % heads != 0) {
                    continue;
                }
                for width in [IndexWidth::I32, IndexWidth::I64] {
                    for op in 0..3 {
                        let rows = page * (2 + rng.below(4) as usize);
                        let dev_rows = page * (2 + rng.below(4) as usize);
                        let npages = 1 + rng.below((rows.min(dev_rows) / page) as u64) as usize;
                        let (h, d) = paged_indices(&mut rng, rows, dev_rows, page, npages);
                        let case = Case {
                            layout,
                            backend,
                            layers,
                            rows,
                            page,
                            heads,
                            items: items.to_vec(),
                            dev_rows,
                            host_idx: h,
                            dev_idx: d,
                            width,
                            op: {
                                let host_layer = rng.below(layers as u64) as usize;
                                match op {
                                    0 => Op::Backup,
                                    1 => Op::BackupLayer { host_layer },
                                    _ => Op::Load { host_layer },
                                }
                            },
                        };
                        case.check(rng.next());
                        cases += 1;
                    }
                }
            }
        }
        assert!(cases > 225, "{cases}");
    }

    #[test]
    fn per_item_backends_take_arbitrary_token_indices() {
        // Kernel and direct layer_first do not need pages: shuffled single tokens (direct
        // layer_first with page size 1, since SGLang's direct ops refuse a partial page).
        let mut rng = Rng(77);
        for &(layout, backend) in &PAIRS[..5] {
            for load in [false, true] {
                let mut c = base_case(layout, backend, vec![16, 8]);
                c.heads = 2;
                if backend == Backend::Direct {
                    c.page = 1;
                }
                let mut h: Vec<i64> = (0..16).collect();
                let mut d: Vec<i64> = (0..12).collect();
                rng.shuffle(&mut h);
                rng.shuffle(&mut d);
                c.host_idx = h[..9].to_vec();
                c.dev_idx = d[..9].to_vec();
                if load {
                    c.op = Op::Load { host_layer: 2 };
                }
                c.check(rng.next());
            }
        }
    }

    #[test]
    fn direct_layer_first_coalesces_runs() {
        let mut c = base_case(Layout::LayerFirst, Backend::Direct, vec![8, 8]);
        c.page = 1; // 7 tokens: not whole pages of 4
                    // Runs: [3,4,5]->[0,1,2], [9]->[7], [10,11]->[3,4], [12]->[6] (device breaks).
        c.host_idx = vec![3, 4, 5, 9, 10, 11, 12];
        c.dev_idx = vec![0, 1, 2, 7, 3, 4, 6];
        let ops = c.check(5);
        // 4 runs x 3 layers x 2 planes; none of them touch across layers or planes.
        assert_eq!(ops.len(), 4 * 3 * 2);
        assert_eq!(total_bytes(&ops), 7 * 3 * 2 * 8);
        c.op = Op::Load { host_layer: 1 };
        assert_eq!(c.check(6).len(), 4 * 2);
    }

    #[test]
    fn direct_layer_first_refuses_a_partial_page_like_sglang() {
        let mut c = base_case(Layout::LayerFirst, Backend::Direct, vec![8, 8]);
        c.host_idx = vec![3, 4, 5, 9, 10];
        c.dev_idx = vec![0, 1, 2, 7, 3];
        expect_err(&c, "Source indices size must be divisible by page size");
        // The kernel backend takes the same tokens.
        c.backend = Backend::Kernel;
        c.check(3);
    }

    #[test]
    fn kernel_plan_coalesces_contiguous_items() {
        let mut c = base_case(Layout::LayerFirst, Backend::Kernel, vec![8]);
        c.host_idx = (4..12).collect();
        c.dev_idx = (0..8).collect();
        c.op = Op::Load { host_layer: 0 };
        let ops = c.check(9);
        assert_eq!(ops.len(), 1);
        assert_eq!(ops[0].len, 64);
    }

    #[test]
    fn page_blocks_move_whole_listed_pages() {
        let mut c = base_case(Layout::PageFirstDirect, Backend::Direct, vec![12, 4]);
        // Host pages 1 and 3; device runs starting at 5 and 0.
        c.host_idx = vec![4, 5, 6, 7, 12, 13, 14, 15];
        c.dev_idx = vec![5, 6, 7, 8, 0, 1, 2, 3];
        let ops = c.check(11);
        assert!(ops.iter().all(|o| o.len % (4 * 4) == 0));
        // 2 pages x 3 layers x 2 planes, no two blocks adjacent on both sides.
        assert_eq!(ops.len(), 12);
        c.op = Op::Load { host_layer: 2 };
        assert_eq!(c.check(12).len(), 4);
    }

    #[test]
    fn page_blocks_refuse_indices_that_are_not_whole_pages() {
        // SGLang reads only the first index of each page; a run that is not the whole page
        // would move rows nobody listed, so it is refused before anything moves.
        let mut c = base_case(Layout::PageFirstDirect, Backend::Direct, vec![12, 4]);
        c.host_idx = vec![4, 5, 6, 7, 12, 13, 14, 15];
        c.dev_idx = vec![5, 6, 7, 8, 3, 2, 1, 0];
        let e = expect_err(
            &c,
            "page 1: device index 2 at position 5 breaks the run 3..7",
        );
        assert!(matches!(e, Error::InvalidTransfer(_)));
        c.dev_idx = vec![5, 6, 7, 8, 0, 1, 2, 3];
        c.host_idx = vec![4, 5, 9, 7, 12, 13, 14, 15];
        expect_err(&c, "page 0: host index 9 at position 2 breaks the run 4..8");
        c.host_idx = vec![5, 6, 7, 8, 12, 13, 14, 15];
        expect_err(
            &c,
            "page 0: host index 5 at position 0 does not start a page",
        );
        c.op = Op::Load { host_layer: 1 };
        expect_err(&c, "does not start a page");
    }

    #[test]
    fn v4_rows_with_page_size_one() {
        let mut rng = Rng(3);
        for &(layout, backend) in &[
            (Layout::LayerFirst, Backend::Kernel),
            (Layout::PageFirst, Backend::Kernel),
            (Layout::LayerFirst, Backend::Direct),
            (Layout::PageFirstDirect, Backend::Direct),
        ] {
            for load in [false, true] {
                let mut c = base_case(layout, backend, vec![584]);
                c.layers = 7;
                c.page = 1;
                c.rows = 10;
                c.dev_rows = 6;
                c.host_idx = vec![9, 2, 3, 0];
                c.dev_idx = vec![1, 2, 3, 5];
                if load {
                    c.op = Op::Load { host_layer: 6 };
                }
                c.check(rng.next());
            }
        }
    }

    fn expect_err(c: &Case, needle: &str) -> Error {
        let mut rng = Rng(1);
        let mut w = c.world(&mut rng);
        let before = (w.host.clone(), w.dev.clone());
        let e = c.run_plan(&mut w).expect_err(needle);
        assert!(
            e.to_string().contains(needle),
            "{e} does not contain {needle:?}"
        );
        assert!(
            w.host == before.0 && w.dev == before.1,
            "a refused transfer wrote bytes"
        );
        e
    }

    fn ok_case() -> Case {
        let mut c = base_case(Layout::PageFirstDirect, Backend::Direct, vec![8, 8]);
        c.host_idx = vec![4, 5, 6, 7];
        c.dev_idx = vec![8, 9, 10, 11];
        c
    }

    #[test]
    fn validation_errors_name_the_problem() {
        let c = ok_case();
        c.check(1);

        let mut b = c.clone();
        b.dev_idx.pop();
        let e = expect_err(
            &b,
            "Source and destination indices must have the same length",
        );
        assert!(matches!(e, Error::InvalidTransfer(_)));

        let mut b = c.clone();
        b.host_idx[2] = -3;
        expect_err(&b, "host index -3 at position 2 is negative");

        let mut b = c.clone();
        b.host_idx[3] = 16;
        expect_err(&b, "host index 16 at position 3 is out of range [0, 16)");

        let mut b = c.clone();
        b.dev_idx[1] = 12;
        expect_err(&b, "device index 12 at position 1 is out of range [0, 12)");

        let mut b = c.clone();
        b.dev_idx = vec![9, 10, 11, 11];
        expect_err(&b, "device page starting at index 9");

        let mut b = c.clone();
        b.host_idx.truncate(3);
        b.dev_idx.truncate(3);
        expect_err(&b, "Source indices size must be divisible by page size");

        let mut b = c.clone();
        b.op = Op::Load { host_layer: 3 };
        expect_err(&b, "host layer 3 is out of range [0, 3)");

        let mut b = c.clone();
        b.layout = Layout::PageFirst;
        let e = expect_err(&b, "Unsupported layout: page_first");
        assert!(matches!(e, Error::Unsupported(_)));

        // int32 values are sign-extended, so a negative int32 is reported as negative.
        let mut b = c.clone();
        b.width = IndexWidth::I32;
        b.dev_idx[0] = -1;
        expect_err(&b, "device index -1 at position 0 is negative");
    }

    #[test]
    fn pointer_counts_and_residency_are_checked() {
        let c = ok_case();
        let mut rng = Rng(1);
        let mut w = c.world(&mut rng);
        let (mut req, _hb, _db) = c.request(&mut w);
        req.device.layer_ptrs.pop();
        let e = build(&req).unwrap_err();
        assert!(
            e.to_string().contains("expected 6 device layer pointers"),
            "{e}"
        );

        let (mut req, _hb, _db) = c.request(&mut w);
        req.dev_idx.on_device = true;
        let e = build(&req).unwrap_err();
        assert!(e.to_string().contains("GPU memory"), "{e}");
        // The CUDA path can still validate the host side alone.
        validate(&req).unwrap();
        req.host_idx.len = 3;
        assert!(validate(&req).is_err());

        let (mut req, _hb, _db) = c.request(&mut w);
        req.host_idx.ptr = 0;
        assert!(build(&req)
            .unwrap_err()
            .to_string()
            .contains("null address"));

        let (mut req, _hb, _db) = c.request(&mut w);
        req.device.layer_ptrs[0] = 0;
        assert!(build(&req)
            .unwrap_err()
            .to_string()
            .contains("device layer pointer"));

        let (mut req, _hb, _db) = c.request(&mut w);
        req.geom.plane_base.pop();
        assert!(matches!(build(&req).unwrap_err(), Error::Geometry(_)));
    }

    #[test]
    fn empty_transfer_is_a_no_op() {
        let mut c = ok_case();
        c.host_idx.clear();
        c.dev_idx.clear();
        assert!(c.check(2).is_empty());
        // Structure is still checked for an empty transfer.
        c.op = Op::Load { host_layer: 9 };
        expect_err(&c, "host layer 9");
    }
}
