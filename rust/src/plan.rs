//! `TransferRequest` -> validated, compact [`Plan`]: the strategy, the geometry and a view of the
//! caller's index arrays. A plan holds no per-copy records: its size does not grow with the
//! transfer. The engines walk the indices again when they copy (the CPU engine in `cpu.rs`, the
//! CUDA copy engine through [`Plan::for_each_copy`]) and compute every copy on the fly.
//!
//! Everything is checked before a plan is returned (one pass over each index array, plus one over
//! the page starts for page-block copies), so an engine that runs a plan can never write outside
//! a pool, and a refused request has moved nothing. The walk re-checks each index it reads against
//! the pool bounds, so an index array that changes under a running transfer (which
//! [`TransferRequest::new`] forbids) stops the transfer with an error instead of leaving the
//! pools. The same checks are available without building a plan ([`validate`]) for engines that
//! do their own addressing (CUDA kernels, emulation).

use std::marker::PhantomData;
use std::ops::Range;

pub use crate::error::Side;
use crate::error::{Error, PlanError, Result};
use crate::index_map::{IndexMap, MapParams};
use crate::index_scan;
use crate::layout::PlaneLayout;
use crate::request::{
    DeviceMemory, HostGeometry, IndexArray, IndexWidth, Layout, Op, TransferRequest,
};

/// Copy `len` bytes from address `src` to address `dst`. Plain data: nothing dereferences a
/// `CopyOp` except the engines, for copies a [`Plan`] produced.
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
    /// Bytes from one device row to the next, per plane: its item size, or the request's row
    /// pitch for strided device rows.
    pub dev_pitch: [u64; 2],
    /// Bytes each device layer of a plane spans from its pointer (`DeviceSide::layer_span`).
    pub dev_span: [u64; 2],
}

impl Checked {
    #[inline]
    fn plane(&self, p: usize) -> PlaneLayout {
        // `planes[..nplanes]` are all `Some` by construction.
        self.planes[p].expect("plane checked in check_structure")
    }
}

fn invalid(msg: String) -> Error {
    Error::transfer(msg)
}

/// Checks that need no index values: geometry, pointer counts, layer id, lengths, page multiple,
/// and that no index array lies in the bytes the transfer may write.
pub fn check_structure(req: &TransferRequest) -> Result<Checked> {
    let g = req.geom();
    let device = req.device();
    let nplanes = g.item_bytes.len();
    if nplanes == 0 || nplanes > 2 || g.plane_base.len() != nplanes {
        return Err(Error::geometry(format!(
            "a host pool has 1 or 2 planes with one base address each; got {} item sizes and {} \
             base addresses",
            nplanes,
            g.plane_base.len()
        )));
    }
    // page_unified interleaves its planes (MHA's K and V) in one allocation: one base, one item
    // size, component `p` of `nplanes`.
    let shared = g.layout == Layout::PageUnified;
    if shared
        && (g.item_bytes.iter().any(|&i| i != g.item_bytes[0])
            || g.plane_base.iter().any(|&b| b != g.plane_base[0]))
    {
        return Err(Error::geometry(format!(
            "page_unified planes share one allocation: they need one base address and one item \
             size, got bases {:x?} and item sizes {:?}",
            g.plane_base, g.item_bytes
        )));
    }
    let mut planes = [None, None];
    for (p, slot) in planes.iter_mut().enumerate().take(nplanes) {
        let pl = PlaneLayout::plane(
            g.layout,
            g.layers,
            g.rows,
            g.page_size,
            g.item_bytes[p],
            g.heads,
            p,
            nplanes,
        )?;
        if g.plane_base[p].checked_add(pl.nbytes).is_none()
            || (g.plane_base[p] == 0 && pl.nbytes > 0)
        {
            return Err(Error::geometry(format!(
                "plane {p} base address {:#x} cannot hold {} bytes",
                g.plane_base[p], pl.nbytes
            )));
        }
        *slot = Some(pl);
    }
    let strategy = crate::support::strategy(g.layout, req.backend())?;
    let (first_layer, layer_count) = match req.op() {
        Op::Backup => (0, g.layers as u64),
        Op::BackupLayer { host_layer } | Op::Load { host_layer } => {
            if host_layer >= g.layers {
                return Err(PlanError::LayerOutOfRange {
                    layer: host_layer as i64,
                    layers: g.layers,
                }
                .into());
            }
            (host_layer as u64, 1)
        }
    };
    let want_ptrs = nplanes as u64 * layer_count;
    if device.layer_ptrs.len() as u64 != want_ptrs {
        return Err(invalid(format!(
            "expected {want_ptrs} device layer pointers ({nplanes} plane(s) x {layer_count} \
             layer(s)), got {}",
            device.layer_ptrs.len()
        )));
    }
    let (h, d) = (req.host_idx(), req.dev_idx());
    let (host_len, dev_len) = (h.count()?, d.count()?);
    if host_len != dev_len {
        return Err(PlanError::LengthMismatch {
            host: host_len,
            device: dev_len,
            pool: None,
        }
        .into());
    }
    let len = host_len;
    // SGLang's direct ops (transfer_kv_direct and the page-first-direct pair) all refuse a
    // partial page; its kernels do not check.
    if strategy != Strategy::PerItem && len as u64 % g.page_size as u64 != 0 {
        return Err(PlanError::PartialPage {
            len,
            page_size: g.page_size,
            pool: None,
        }
        .into());
    }
    if let Some(pitch) = device.row_pitch {
        check_row_pitch(g, req.op(), strategy, pitch)?;
    }
    let (mut dev_pitch, mut dev_span) = ([0; 2], [0; 2]);
    for (p, &item) in g.item_bytes.iter().enumerate() {
        dev_pitch[p] = device.pitch(item as u64);
        let span = device.layer_span(item as u64);
        dev_span[p] = span.unwrap_or(u64::MAX); // refused below wherever a layer is moved
        if len == 0 {
            continue;
        }
        let ptrs = &device.layer_ptrs[p * layer_count as usize..][..layer_count as usize];
        for &ptr in ptrs {
            if ptr == 0 || span.and_then(|s| ptr.checked_add(s)).is_none() {
                return Err(invalid(format!(
                    "device layer pointer {ptr:#x} cannot address {} rows of {item} bytes",
                    device.rows
                )));
            }
        }
    }
    // Whether [lo, hi) meets the bytes the transfer may write: the host planes (a backup), the
    // moved device layers (a load).
    let lc = layer_count as usize;
    let writes = |lo: u64, hi: u64| {
        let meets = |base: u64, n: u64| n > 0 && lo < base.saturating_add(n) && base < hi;
        if req.op().to_host() {
            (0..nplanes).any(|p| meets(g.plane_base[p], planes[p].as_ref().map_or(0, |l| l.nbytes)))
        } else {
            (0..nplanes).any(|p| {
                let ptrs = &device.layer_ptrs[p * lc..][..lc];
                ptrs.iter().any(|&ptr| meets(ptr, dev_span[p]))
            })
        }
    };
    if len > 0 {
        for (which, idx) in [("host", h), ("device", d)] {
            if idx.ptr == 0 {
                return Err(invalid(format!("{which} index array has a null address")));
            }
            let span = (idx.len as u64).checked_mul(idx.width.bytes() as u64);
            let Some(end) = span
                .filter(|&n| n <= isize::MAX as u64)
                .and_then(|n| idx.ptr.checked_add(n))
            else {
                return Err(invalid(format!(
                    "{which} index array of {} elements at {:#x} is not addressable",
                    idx.len, idx.ptr
                )));
            };
            // The engines read an index array more than once (validation, then the copy): one
            // lying in the bytes this transfer writes would be rewritten under them, and rows
            // outside the listed ones written. Torch refuses such an aliased index too.
            if writes(idx.ptr, end) {
                let into = if req.op().to_host() {
                    "host pool"
                } else {
                    "device layer"
                };
                return Err(invalid(format!(
                    "the {which} index array lies in the {into} memory this transfer writes, \
                     which would rewrite it while it is read; pass a copy (clone()) of it"
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
        dev_pitch,
        dev_span,
    })
}

/// Strided device rows (`pitch` bytes apart) hold at least a row of every plane, and move one
/// row at a time: a page block is one copy only where the device rows are packed, so the copy
/// engine's page_first_direct refuses them, with SGLang's text. page_head is refused too, as
/// SGLang refuses it on every platform: its head-major kernels have no strided form.
fn check_row_pitch(g: &HostGeometry, op: Op, strategy: Strategy, pitch: u64) -> Result<()> {
    if let Some(&item) = g.item_bytes.iter().find(|&&item| (item as u64) > pitch) {
        return Err(invalid(format!(
            "device rows {pitch} bytes apart cannot hold rows of {item} bytes"
        )));
    }
    let kernels = match (strategy, g.layout) {
        (Strategy::PageBlocks, _) => Some((
            "transfer_kv_all_layer_direct_lf_pf",
            "transfer_kv_per_layer_direct_pf_lf",
        )),
        (_, Layout::PageHead) => {
            Some(("transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_ph_lf"))
        }
        _ => None,
    };
    if let Some((backup, load)) = kernels {
        let kernel = if op.to_host() { backup } else { load };
        return Err(Error::not_implemented(format!(
            "HiCache: {kernel} steps device rows by the row width ({} B), but this device \
             pool's rows are {pitch} B apart. Use the JIT HiCache kernels with a layer_first or \
             page_first host layout.",
            g.item_bytes[0]
        )));
    }
    Ok(())
}

/// A read-only view of `raw_len` int32 or int64 indices in memory that stays readable and
/// unchanged for `'a`, read through an [`IndexMap`]: position `i` of the `len` positions reads a
/// raw element and maps its value. Reads are unaligned (nothing promised alignment) and
/// bounds-checked.
#[derive(Clone, Copy, Debug)]
pub struct IndexView<'a> {
    addr: u64,
    len: usize,
    raw_len: usize,
    width: IndexWidth,
    map: MapParams,
    _bytes: PhantomData<&'a [u8]>,
}

impl<'a> IndexView<'a> {
    /// The indices encoded in `bytes` (native endianness); a partial trailing element is ignored.
    pub fn from_bytes(bytes: &'a [u8], width: IndexWidth) -> Self {
        let n = bytes.len() / width.bytes();
        Self {
            addr: bytes.as_ptr() as u64,
            len: n,
            raw_len: n,
            width,
            map: MapParams::IDENTITY,
            _bytes: PhantomData,
        }
    }

    /// The same raw elements read through `map` (replacing any earlier map).
    pub fn with_map(self, map: IndexMap) -> Result<Self> {
        Ok(Self {
            len: map.count(self.raw_len)?,
            map: map.params(),
            ..self
        })
    }

    /// The host-resident array `idx` describes.
    ///
    /// # Safety
    /// `idx.len * idx.width.bytes()` bytes at `idx.ptr` are readable CPU memory that nobody
    /// writes for `'a` (what [`TransferRequest::new`] requires of its host-resident arrays, for
    /// as long as the request is borrowed).
    unsafe fn from_array(idx: &IndexArray) -> Result<Self> {
        Ok(Self {
            addr: idx.ptr,
            len: idx.count()?,
            raw_len: idx.len,
            width: idx.width,
            map: idx.map.params(),
            _bytes: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn width(&self) -> IndexWidth {
        self.width
    }

    /// Position `i`: its raw element (an int32 is sign-extended) through the map. Panics when
    /// `i >= len`.
    #[inline(always)]
    pub fn get(&self, i: usize) -> i64 {
        self.map.apply(self.raw(i))
    }

    /// Position `i`'s raw element, before the map. Panics when `i >= len`.
    #[inline(always)]
    pub fn raw(&self, i: usize) -> i64 {
        assert!(i < self.len, "index position {i} past {}", self.len);
        let k = self.map.raw_position(i);
        // `len` positions read raw elements below `raw_len` (`IndexMap::count`); checked again
        // because the reads below rely on it.
        assert!(
            k < self.raw_len,
            "raw index element {k} past {}",
            self.raw_len
        );
        match self.width {
            // SAFETY: `k < raw_len`, and the view's `raw_len` elements are readable for `'a` (a
            // borrowed slice in `from_bytes`, the caller's promise in `from_array`); unaligned
            // reads need no alignment.
            IndexWidth::I32 => unsafe { (self.addr as *const i32).add(k).read_unaligned() as i64 },
            // SAFETY: as above, for 8-byte elements.
            IndexWidth::I64 => unsafe { (self.addr as *const i64).add(k).read_unaligned() },
        }
    }

    /// The elements as one slice when they are read as stored (int64, no map, aligned): the
    /// checks' fast path, which the compiler vectorises; `get` serves every other array.
    fn plain_i64(&self) -> Option<&'a [i64]> {
        let plain = self.width == IndexWidth::I64
            && self.map == MapParams::IDENTITY
            && self.len == self.raw_len
            && self.addr % std::mem::align_of::<i64>() as u64 == 0;
        // SAFETY: `len` aligned int64 elements at `addr` are readable for `'a` (see `get`).
        plain.then(|| unsafe { std::slice::from_raw_parts(self.addr as *const i64, self.len) })
    }

    fn span(&self) -> (u64, u64) {
        (
            self.addr,
            self.addr + (self.raw_len * self.width.bytes()) as u64,
        )
    }
}

/// The first value of `view` outside `[0, bound)`, as the error the pools raise.
fn check_range(side: Side, view: &IndexView<'_>, bound: u64) -> Result<()> {
    if view.map.rem_mul != 0 {
        // It reads every row against the bound already.
        return check_tokens(side, view, bound);
    }
    if let Some(values) = view.plain_i64() {
        // A negative value reads as past any bound; the loop below then names the first culprit.
        if !index_scan::any_outside(values, bound) {
            return Ok(());
        }
    }
    for position in 0..view.len() {
        let value = view.get(position);
        if value < 0 {
            return Err(PlanError::Negative {
                side,
                position,
                value,
            }
            .into());
        }
        if value as u64 >= bound {
            return Err(PlanError::OutOfRange {
                side,
                position,
                value,
                bound,
            }
            .into());
        }
    }
    Ok(())
}

/// Token indices read through a C4 map (a remainder term): a token whose row falls outside
/// `[0, bound)` is refused in the caller's terms, its tokens and the tokens those rows hold,
/// which is all the caller knows.
fn check_tokens(side: Side, view: &IndexView<'_>, bound: u64) -> Result<()> {
    let (mut min, mut max, mut outside) = (i64::MAX, i64::MIN, false);
    for i in 0..view.len() {
        let (t, row) = (view.raw(i), view.get(i));
        (min, max) = (min.min(t), max.max(t));
        outside |= row < 0 || row as u64 >= bound;
    }
    if outside {
        return Err(PlanError::TokenOutOfRange {
            side,
            min,
            max,
            bound: token_bound(&view.map, bound),
        }
        .into());
    }
    Ok(())
}

/// How many tokens `bound` rows hold under a C4 map: each page of `div` tokens maps to `mul`
/// rows, token `r` of a page to row `r * rem_mul + add` of it, so whole pages hold `div` each
/// and a last partial page the tokens whose row it still has.
fn token_bound(map: &MapParams, bound: u64) -> u64 {
    let (div, mul) = (map.div.max(1) as u64, map.mul.max(1) as u64);
    let (rem_mul, add) = (map.rem_mul.max(1) as u64, map.add.max(0) as u64);
    let whole = bound / mul;
    let left = bound - whole * mul;
    let partial = if left > add {
        (left - add).div_ceil(rem_mul).min(div)
    } else {
        0
    };
    whole * div + partial
}

/// A page-block copy moves whole pages: `P` host slots starting at a page boundary and `P`
/// consecutive device rows, found from the first index of each page. Refuse any page whose
/// indices say otherwise, or the copy would move rows that were not listed. Both views are
/// already range-checked.
fn check_pages(host: &IndexView<'_>, dev: &IndexView<'_>, p: usize, dev_rows: u64) -> Result<()> {
    if let (Some(h), Some(d)) = (host.plain_i64(), dev.plain_i64()) {
        if index_scan::pages_hold(h, d, p, dev_rows) {
            return Ok(());
        }
    }
    let pu = p as u64;
    let pages = host.len() / p;
    for k in 0..pages {
        let d = dev.get(k * p) as u64;
        if d + pu > dev_rows {
            return Err(PlanError::PageOutsideDevice {
                start: d,
                position: k * p,
                end: d + pu,
                rows: dev_rows,
            }
            .into());
        }
    }
    for k in 0..pages {
        let first = k * p;
        let h0 = host.get(first);
        if h0 as u64 % pu != 0 {
            return Err(PlanError::PageNotAligned {
                page: k,
                side: Side::Host,
                value: h0 as u64,
                position: first,
                page_size: pu,
            }
            .into());
        }
        for (side, view) in [(Side::Host, host), (Side::Device, dev)] {
            let v0 = view.get(first);
            if let Some(j) = (1..p).find(|&j| view.get(first + j) != v0 + j as i64) {
                return Err(PlanError::PageRunBroken {
                    page: k,
                    side,
                    value: view.get(first + j),
                    position: first + j,
                    start: v0 as u64,
                    end: v0 as u64 + pu,
                    page_size: pu,
                }
                .into());
            }
        }
    }
    Ok(())
}

/// Page-row transfers (DeepSeek V4) move one row per page and read the row from the first index
/// of each page, as SGLang does; the other indices of the page must continue that one as one
/// whole page, or the copy would move a page nobody listed whole. A GPU-resident array is read
/// only by the kernel, which reads the first index of each page alone.
fn check_page_rows(req: &TransferRequest) -> Result<()> {
    for (side, idx) in [(Side::Host, req.host_idx()), (Side::Device, req.dev_idx())] {
        let IndexMap::PageRows { page } = idx.map else {
            continue;
        };
        if idx.on_device {
            continue;
        }
        let raw = IndexArray {
            map: IndexMap::Identity,
            ..*idx
        };
        // SAFETY: the same host-resident bytes as the request's own array, which
        // `TransferRequest::new` makes readable and unchanged while the request lives; the view
        // is dropped before this function returns.
        let view = unsafe { IndexView::from_array(&raw) }?;
        let p = page as usize;
        for k in 0..view.len() / p {
            let first = k * p;
            let v0 = view.get(first);
            if v0.rem_euclid(p as i64) != 0 {
                return Err(PlanError::PageNotAligned {
                    page: k,
                    side,
                    value: v0 as u64,
                    position: first,
                    page_size: p as u64,
                }
                .into());
            }
            if let Some(j) = (1..p).find(|&j| view.get(first + j) != v0 + j as i64) {
                return Err(PlanError::PageRunBroken {
                    page: k,
                    side,
                    value: view.get(first + j),
                    position: first + j,
                    start: v0 as u64,
                    end: v0 as u64 + p as u64,
                    page_size: p as u64,
                }
                .into());
            }
        }
    }
    Ok(())
}

fn gpu_indices_refused() -> Error {
    invalid("indices are in GPU memory; the CPU engine needs CPU index tensors".into())
}

/// Runs every check, reading host-resident indices; `on_device` indices are left to the kernel
/// (which checks them itself). Nothing is copied and nothing is kept.
pub fn validate(req: &TransferRequest) -> Result<Checked> {
    let c = check_structure(req)?;
    if c.len == 0 {
        return Ok(c);
    }
    let hv = index_view(req, Side::Host).ok();
    let dv = index_view(req, Side::Device).ok();
    if let Some(hv) = &hv {
        check_range(Side::Host, hv, req.geom().rows as u64)?;
    }
    if let Some(dv) = &dv {
        check_range(Side::Device, dv, req.device().rows as u64)?;
    }
    if let (Some(hv), Some(dv), Strategy::PageBlocks) = (&hv, &dv, c.strategy) {
        check_pages(hv, dv, req.geom().page_size, req.device().rows as u64)?;
    }
    check_page_rows(req)?;
    Ok(c)
}

/// A view of `req`'s host-resident index array `side`, borrowing the request; refused for an
/// `on_device` array (GPU memory, or read only by the kernels).
pub fn index_view(req: &TransferRequest, side: Side) -> Result<IndexView<'_>> {
    let idx = match side {
        Side::Host => req.host_idx(),
        Side::Device => req.dev_idx(),
    };
    if idx.on_device {
        return Err(gpu_indices_refused());
    }
    // SAFETY: a host-resident array of the request: `TransferRequest::new` makes its bytes
    // readable CPU memory that stays unchanged while the request lives, and the view borrows the
    // request.
    unsafe { IndexView::from_array(idx) }
}

/// Validates `req` (everything [`validate`] checks, host-resident indices required) and returns
/// its plan. Backup copies device -> host for every layer; load copies one host layer into one
/// device layer. The plan borrows the request: the caller's arrays are read again when it runs.
pub fn build(req: &TransferRequest) -> Result<Plan<'_>> {
    let c = check_structure(req)?;
    if req.host_idx().on_device || req.dev_idx().on_device {
        return Err(gpu_indices_refused());
    }
    let hv = index_view(req, Side::Host)?;
    let dv = index_view(req, Side::Device)?;
    finish(req, c, hv, dv)
}

/// [`build`] with index values from elsewhere (the CUDA direct backend's host copies of
/// GPU-resident arrays): `host` and `dev` stand for the request's arrays and must have their
/// lengths.
pub(crate) fn build_with<'a>(
    req: &'a TransferRequest,
    host: IndexView<'a>,
    dev: IndexView<'a>,
) -> Result<Plan<'a>> {
    let c = check_structure(req)?;
    if host.len() != c.len || dev.len() != c.len {
        return Err(invalid(format!(
            "index copies of {} and {} elements stand for arrays of {}",
            host.len(),
            dev.len(),
            c.len
        )));
    }
    finish(req, c, host, dev)
}

fn finish<'a>(
    req: &'a TransferRequest,
    c: Checked,
    host: IndexView<'a>,
    dev: IndexView<'a>,
) -> Result<Plan<'a>> {
    let g = req.geom();
    let device = req.device();
    let (host_rows, dev_rows) = (g.rows as u64, device.rows as u64);
    if c.len > 0 {
        check_range(Side::Host, &host, host_rows)?;
        check_range(Side::Device, &dev, dev_rows)?;
        if c.strategy == Strategy::PageBlocks {
            check_pages(&host, &dev, g.page_size, dev_rows)?;
        }
        check_page_rows(req)?;
    }
    let planes = [c.plane(0), c.plane(c.nplanes - 1)];
    let plane_base = [g.plane_base[0], g.plane_base[c.nplanes - 1]];
    let layer_count = c.layer_count as usize;
    let per_index: u64 = planes[..c.nplanes].iter().map(|pl| pl.item).sum();
    // Saturating: repeated indices may name more bytes than the pools hold (never realistic;
    // the count only sizes work).
    let bytes = (c.len as u64)
        .saturating_mul(c.layer_count)
        .saturating_mul(per_index);
    let mut plan = Plan {
        strategy: c.strategy,
        to_host: req.op().to_host(),
        memory: device.memory,
        nplanes: c.nplanes,
        planes,
        plane_base,
        layer_ptrs: &device.layer_ptrs,
        first_layer: c.first_layer,
        layer_count,
        len: c.len,
        page: g.page_size,
        host,
        dev,
        host_rows,
        dev_rows,
        dev_pitch: c.dev_pitch,
        dev_span: c.dev_span,
        bytes,
        disjoint: true,
    };
    plan.disjoint = plan.spans_disjoint();
    Ok(plan)
}

/// A validated transfer, ready to run: strategy, geometry, the device layer table and views of the
/// index arrays, all borrowed from the request (and whatever backs the views). Its size is fixed
/// (no allocation): copies are computed while walking the indices.
///
/// Work is split into *units*: one index position for [`Strategy::PerItem`] and
/// [`Strategy::Runs`] (a run stops at the end of a unit range), one `(page, plane, layer)` block
/// for [`Strategy::PageBlocks`]. Any partition of `0..units()` into ranges, each run once, moves
/// exactly the transfer's bytes.
#[derive(Debug)]
pub struct Plan<'a> {
    strategy: Strategy,
    to_host: bool,
    memory: DeviceMemory,
    nplanes: usize,
    /// `planes[..nplanes]` are the request's planes (the second repeats the first for one plane).
    planes: [PlaneLayout; 2],
    plane_base: [u64; 2],
    layer_ptrs: &'a [u64],
    first_layer: u64,
    layer_count: usize,
    len: usize,
    page: usize,
    host: IndexView<'a>,
    dev: IndexView<'a>,
    host_rows: u64,
    dev_rows: u64,
    /// Bytes from one device row to the next, per plane (see [`Checked::dev_pitch`]).
    dev_pitch: [u64; 2],
    /// Bytes each device layer of a plane spans (see [`Checked::dev_span`]).
    dev_span: [u64; 2],
    bytes: u64,
    disjoint: bool,
}

impl<'a> Plan<'a> {
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Index positions (the length of each index array).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the transfer moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// True when bytes move device -> host (the host planes are written).
    pub fn to_host(&self) -> bool {
        self.to_host
    }

    /// What the device layer pointers address (the CPU engine runs only host memory).
    pub fn device_memory(&self) -> DeviceMemory {
        self.memory
    }

    /// Work units (see the type's doc).
    pub fn units(&self) -> usize {
        match self.strategy {
            Strategy::PerItem | Strategy::Runs => self.len,
            Strategy::PageBlocks => self.len / self.page * self.nplanes * self.layer_count,
        }
    }

    /// Bytes of the smallest copy the plan makes before merging neighbours: a head segment, an
    /// item, or a page block. Engines use it to judge per-copy overhead.
    pub fn min_piece(&self) -> u64 {
        let pl = &self.planes[..self.nplanes];
        let min = |f: fn(&PlaneLayout) -> u64| pl.iter().map(f).min().unwrap_or(0);
        match self.strategy {
            Strategy::PerItem => min(|p| p.segment),
            Strategy::Runs => min(|p| p.item),
            Strategy::PageBlocks => min(|p| p.item * p.page_size),
        }
    }

    /// True when the walk writes the host side in address order, piece after piece: a per-item
    /// backup of several layers where the layers of a row are adjacent (page_first, page_head;
    /// see `walk_items`).
    pub fn writes_host_in_order(&self) -> bool {
        self.strategy == Strategy::PerItem
            && self.to_host
            && self.layer_count > 1
            && self.layers_adjacent()
    }

    fn layers_adjacent(&self) -> bool {
        matches!(self.planes[0].layout, Layout::PageFirst | Layout::PageHead)
    }

    /// True when no byte the transfer writes is also read or written by another part of it
    /// (sources, other destinations, the index arrays): copies may then run in any order, on
    /// any thread, with `memcpy`. False only for a request whose pools overlap.
    pub fn disjoint(&self) -> bool {
        self.disjoint
    }

    /// The host planes' byte ranges: page_unified's interleaved planes are one range (they never
    /// meet each other, and together they fill it).
    fn host_spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let distinct = if self.planes[0].components > 1 {
            1
        } else {
            self.nplanes
        };
        (0..distinct).map(|p| {
            (
                self.plane_base[p],
                self.plane_base[p] + self.planes[p].nbytes,
            )
        })
    }

    /// The device layers' byte ranges (`rows` rows from each pointer, the last one only its
    /// own bytes), plane-major.
    fn dev_spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        // Plane by plane (the pointers are plane-major), so no pointer divides to find its plane:
        // this runs for every call, over every layer.
        self.layer_ptrs
            .chunks(self.layer_count.max(1))
            .zip(self.dev_span)
            .flat_map(|(ptrs, span)| ptrs.iter().map(move |&ptr| (ptr, ptr + span)))
    }

    /// Whether the strided rows of device layers `i` and `j` (in `dev_spans` order, whose
    /// ranges meet) share a byte: SGLang's unified pools interleave every layer's K and V rows
    /// in one buffer, so their ranges overlap while their rows, one pitch apart each, need not.
    fn strided_rows_meet(&self, (i, a): (usize, u64), (j, b): (usize, u64)) -> bool {
        let plane = |k: usize| k / self.layer_count.max(1);
        let (pi, pj) = (plane(i), plane(j));
        let pitch = self.dev_pitch[pi];
        let (wi, wj) = (self.planes[pi].item, self.planes[pj].item);
        if pitch == wi || pitch != self.dev_pitch[pj] {
            return true; // packed rows: their ranges are their bytes
        }
        // `j`'s rows start `r` bytes into each of `i`'s.
        let r = (b as i128 - a as i128).rem_euclid(pitch as i128) as u64;
        r < wi || r + wj > pitch
    }

    /// Whether the ranges the transfer writes (whole host planes for a backup, whole device
    /// layers for a load) meet each other, the ranges it reads, or the index arrays. A few
    /// ranges (at most 2 destinations, 2 x layers sources), never per index, and no allocation.
    fn spans_disjoint(&self) -> bool {
        if self.len == 0 {
            return true;
        }
        let meets = |a: (u64, u64), b: (u64, u64)| a.0 < b.1 && b.0 < a.1;
        let idx = [self.host.span(), self.dev.span()];
        let (dst_host, dst_dev) = (self.to_host, !self.to_host);
        let dst = || {
            self.host_spans()
                .filter(move |_| dst_host)
                .chain(self.dev_spans().filter(move |_| dst_dev))
        };
        let src = || {
            self.host_spans()
                .filter(move |_| !dst_host)
                .chain(self.dev_spans().filter(move |_| !dst_dev))
        };
        dst().enumerate().all(|(i, a)| {
            dst().enumerate().skip(i + 1).all(|(j, b)| {
                !meets(a, b) || (dst_dev && !self.strided_rows_meet((i, a.0), (j, b.0)))
            }) && src().all(|b| !meets(a, b))
                && idx.iter().all(|&b| !meets(a, b))
        })
    }

    /// Calls `f` with every copy of the units `units` (coalesced where both sides continue the
    /// previous copy exactly), in order; stops at the first error `f` returns. Each copy lies
    /// inside one host plane and one device layer of the request, and its host side inside the
    /// pages the indices name. Panics if `units` is not inside `0..units()`.
    pub fn for_each_copy(
        &self,
        units: Range<usize>,
        mut f: impl FnMut(CopyOp) -> Result<()>,
    ) -> Result<()> {
        let mut failed = None;
        let done = self.walk(units, &mut |op| match f(op) {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        });
        match failed {
            Some(e) => Err(e),
            None => done,
        }
    }

    /// The walk behind every engine: calls `emit` with each (coalesced) copy of `units` until it
    /// returns false. Every copy lies inside one host plane of the request and one of its device
    /// layers: all offsets come from validated geometry and from index values re-checked as they
    /// are read (an index found out of range now, although validation accepted it, stops the
    /// walk with an error: its array changed during the call).
    pub(crate) fn walk(
        &self,
        units: Range<usize>,
        emit: &mut impl FnMut(CopyOp) -> bool,
    ) -> Result<()> {
        assert!(
            units.start <= units.end && units.end <= self.units(),
            "units {units:?} outside 0..{}",
            self.units()
        );
        let mut sink = Coalesce {
            cur: CopyOp {
                src: 0,
                dst: 0,
                len: 0,
            },
            emit,
            stopped: false,
        };
        let r = match self.strategy {
            Strategy::PerItem => self.walk_items(units, &mut sink),
            Strategy::Runs => self.walk_runs(units, &mut sink),
            Strategy::PageBlocks => self.walk_pages(units, &mut sink),
        };
        sink.flush();
        r
    }

    #[inline(always)]
    fn host_at(&self, i: usize) -> Result<u64> {
        let v = self.host.get(i);
        if v < 0 || v as u64 >= self.host_rows {
            return Err(changed(Side::Host, v, i));
        }
        Ok(v as u64)
    }

    #[inline(always)]
    fn dev_at(&self, i: usize) -> Result<u64> {
        let v = self.dev.get(i);
        if v < 0 || v as u64 >= self.dev_rows {
            return Err(changed(Side::Device, v, i));
        }
        Ok(v as u64)
    }

    #[inline(always)]
    fn dev_base(&self, p: usize, k: usize) -> u64 {
        self.layer_ptrs[p * self.layer_count + k]
    }

    /// Per item. Backups write many layers of each row, so the walk follows the host layout:
    /// where the layers of a row are adjacent (page_first, page_head: layer stride `I` or
    /// `I / H`) it goes plane, index, head, layer, writing each (row, head) in address order;
    /// where they are far apart (layer_first, page_first_direct) it goes plane, layer, index,
    /// head, so that consecutive indices continue one another and coalesce. Measured on 512 MiB
    /// backups: 4-7x faster than layer-major for page_first / page_head with 16-128-byte
    /// pieces, and 1.5x slower than layer-major for the other two. A load (one layer) walks the
    /// same either way.
    fn walk_items<F: FnMut(CopyOp) -> bool>(
        &self,
        units: Range<usize>,
        sink: &mut Coalesce<'_, F>,
    ) -> Result<()> {
        let layers_adjacent = self.layers_adjacent();
        for p in 0..self.nplanes {
            let pl = &self.planes[p];
            let base = self.plane_base[p];
            let (pitch, seg) = (self.dev_pitch[p], pl.segment);
            let (head_stride, layer_stride) = (pl.head_stride(), pl.layer_stride());
            if layers_adjacent {
                for j in units.clone() {
                    let (t, d) = (self.host_at(j)?, self.dev_at(j)?);
                    // t < S, d < device rows, every layer in [0, L), every head in [0, H): each
                    // piece lies in the plane (checked geometry) and in its device layer.
                    let host0 = base + pl.offset_unchecked(t, self.first_layer, 0);
                    let dev0 = d * pitch;
                    for h in 0..pl.heads {
                        for k in 0..self.layer_count {
                            let host = host0 + h * head_stride + k as u64 * layer_stride;
                            let dev = self.dev_base(p, k) + dev0 + h * seg;
                            if !sink.push(self.to_host, host, dev, seg) {
                                return Ok(());
                            }
                        }
                    }
                }
            } else {
                for k in 0..self.layer_count {
                    let layer = self.first_layer + k as u64;
                    let dev_base = self.dev_base(p, k);
                    for j in units.clone() {
                        let (t, d) = (self.host_at(j)?, self.dev_at(j)?);
                        // As above.
                        let host = base + pl.offset_unchecked(t, layer, 0);
                        let dev = dev_base + d * pitch;
                        for h in 0..pl.heads {
                            if !sink.push(self.to_host, host + h * head_stride, dev + h * seg, seg)
                            {
                                return Ok(());
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn walk_runs<F: FnMut(CopyOp) -> bool>(
        &self,
        units: Range<usize>,
        sink: &mut Coalesce<'_, F>,
    ) -> Result<()> {
        let mut i = units.start;
        while i < units.end {
            let (t0, d0) = (self.host_at(i)?, self.dev_at(i)?);
            let mut j = i + 1;
            while j < units.end {
                let step = (j - i) as u64;
                let (t, d) = (t0 + step, d0 + step);
                // Equal to an in-range successor on both sides, so itself in range.
                if self.host.get(j) == t as i64
                    && self.dev.get(j) == d as i64
                    && t < self.host_rows
                    && d < self.dev_rows
                {
                    j += 1;
                } else {
                    break;
                }
            }
            let n = (j - i) as u64;
            for p in 0..self.nplanes {
                let (pl, pitch) = (&self.planes[p], self.dev_pitch[p]);
                for k in 0..self.layer_count {
                    let layer = self.first_layer + k as u64;
                    // layer_first: rows t0..t0+n of a layer are contiguous in the host pool, and
                    // in the device layer where its rows are packed (else one copy per row).
                    let host = self.plane_base[p] + pl.offset_unchecked(t0, layer, 0);
                    let dev = self.dev_base(p, k) + d0 * pitch;
                    let (rows, len) = if pitch == pl.item {
                        (1, n * pl.item)
                    } else {
                        (n, pl.item)
                    };
                    for r in 0..rows {
                        if !sink.push(self.to_host, host + r * len, dev + r * pitch, len) {
                            return Ok(());
                        }
                    }
                }
            }
            i = j;
        }
        Ok(())
    }

    fn walk_pages<F: FnMut(CopyOp) -> bool>(
        &self,
        units: Range<usize>,
        sink: &mut Coalesce<'_, F>,
    ) -> Result<()> {
        let per_page = self.nplanes * self.layer_count;
        let p = self.page as u64;
        let mut cached = usize::MAX;
        let (mut t, mut d) = (0u64, 0u64);
        for u in units {
            let page = u / per_page;
            let (plane, k) = ((u % per_page) / self.layer_count, u % self.layer_count);
            if page != cached {
                let first = page * self.page;
                (t, d) = (self.host_at(first)?, self.dev_at(first)?);
                // Validated whole pages: re-checked so that a changed array cannot move the
                // block out of either pool.
                if t % p != 0 || t + p > self.host_rows {
                    return Err(changed(Side::Host, t as i64, first));
                }
                if d + p > self.dev_rows {
                    return Err(changed(Side::Device, d as i64, first));
                }
                cached = page;
            }
            let pl = &self.planes[plane];
            let layer = self.first_layer + k as u64;
            let host = self.plane_base[plane] + pl.page_block_offset(t / p, layer);
            let dev = self.dev_base(plane, k) + d * pl.item;
            if !sink.push(self.to_host, host, dev, p * pl.item) {
                return Ok(());
            }
        }
        Ok(())
    }
}

fn changed(side: Side, value: i64, position: usize) -> Error {
    PlanError::Changed {
        side,
        position,
        value,
    }
    .into()
}

/// Merges a copy into the previous one when both sides continue it exactly (the bytes moved are
/// the same; fewer, longer copies are faster), and hands the others on.
pub(crate) struct Coalesce<'e, F: FnMut(CopyOp) -> bool> {
    cur: CopyOp,
    emit: &'e mut F,
    stopped: bool,
}

impl<F: FnMut(CopyOp) -> bool> Coalesce<'_, F> {
    /// One copy between `host` and `dev` (direction `to_host`); false once `emit` said stop.
    #[inline(always)]
    fn push(&mut self, to_host: bool, host: u64, dev: u64, len: u64) -> bool {
        let (src, dst) = if to_host { (dev, host) } else { (host, dev) };
        let c = &mut self.cur;
        if c.len != 0 && c.src + c.len == src && c.dst + c.len == dst {
            c.len += len;
            return true;
        }
        let prev = std::mem::replace(c, CopyOp { src, dst, len });
        if prev.len != 0 && !(self.emit)(prev) {
            self.stopped = true;
            self.cur.len = 0;
            return false;
        }
        true
    }

    fn flush(&mut self) {
        if self.cur.len != 0 && !self.stopped {
            (self.emit)(self.cur);
        }
        self.cur.len = 0;
    }
}

/// Bytes a list of copies moves.
pub fn total_bytes(ops: &[CopyOp]) -> u64 {
    ops.iter().map(|o| o.len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Backend, DeviceSide, HostGeometry};

    type Parts = (
        HostGeometry,
        Backend,
        Op,
        DeviceSide,
        IndexArray,
        IndexArray,
    );

    trait CloneParts {
        fn clone_parts(&self) -> Parts;
    }

    #[test]
    fn c4_token_refusals_name_the_callers_tokens() {
        use crate::pool::c4;
        let view_of =
            |tokens: &[i64]| -> Vec<u8> { tokens.iter().flat_map(|t| t.to_ne_bytes()).collect() };
        let rows = 3 * c4::VALUES_PER_ROW; // three pages of value rows: tokens [0, 192)
        for (bound, tokens, text) in [
            (
                rows,
                vec![5, 192],
                Some("host token indices must lie in [0, 192), got min=5, max=192"),
            ),
            (
                rows,
                vec![-1, 2],
                Some("host token indices must lie in [0, 192), got min=-1, max=2"),
            ),
            (rows, vec![0, 191], None),
            // Rows that end inside a page hold the tokens whose rows they have (4 rows: 4).
            (4, vec![0, 3], None),
            (
                4,
                vec![1, 4],
                Some("host token indices must lie in [0, 4), got min=1, max=4"),
            ),
        ] {
            let bytes = view_of(&tokens);
            let view = IndexView::from_bytes(&bytes, IndexWidth::I64)
                .with_map(IndexMap::C4Value)
                .unwrap();
            let got = check_range(Side::Host, &view, bound);
            match text {
                Some(t) => {
                    assert_eq!(
                        got.unwrap_err().to_string(),
                        format!("token-granular transfer: {t}")
                    )
                }
                None => got.unwrap(),
            }
        }
    }

    impl CloneParts for Parts {
        fn clone_parts(&self) -> Parts {
            (
                self.0.clone(),
                self.1,
                self.2,
                self.3.clone(),
                self.4,
                self.5,
            )
        }
    }

    /// A request over buffers the test owns.
    ///
    /// # Safety
    /// As for `TransferRequest::new`: the addresses in `geom`, `device` and the index arrays
    /// name live test buffers of the sizes they state, alive and untouched while it is used.
    unsafe fn req_from((geom, backend, op, device, host_idx, dev_idx): Parts) -> TransferRequest {
        // SAFETY: the caller's promise, passed on.
        unsafe { TransferRequest::new(geom, backend, op, device, host_idx, dev_idx) }
    }

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

    /// Every copy of a plan, in walk order.
    fn copies(plan: &Plan<'_>) -> Vec<CopyOp> {
        let mut v = Vec::new();
        plan.for_each_copy(0..plan.units(), |op| {
            v.push(op);
            Ok(())
        })
        .unwrap();
        v
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
        /// How both index arrays are read (the reference reads the mapped values).
        map: IndexMap,
        /// Strided device rows: bytes from one row to the next (None: packed).
        row_pitch: Option<usize>,
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

        /// Bytes between the device rows of a plane of `item`-byte rows.
        fn pitch(&self, item: usize) -> usize {
            self.row_pitch.unwrap_or(item)
        }

        /// page_unified's planes share one host buffer.
        fn shared(&self) -> bool {
            self.layout == Layout::PageUnified
        }

        fn world(&self, rng: &mut Rng) -> World {
            let host = if self.shared() {
                let c = self.items.len();
                vec![rng.bytes(c * self.layers * self.rows * self.items[0])]
            } else {
                self.items
                    .iter()
                    .map(|&i| rng.bytes(self.layers * self.rows * i))
                    .collect()
            };
            World {
                host,
                dev: self
                    .items
                    .iter()
                    .map(|&i| {
                        (0..self.device_layers())
                            .map(|_| rng.bytes(self.dev_rows * self.pitch(i)))
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
            let geom = HostGeometry {
                layout: self.layout,
                layers: self.layers,
                rows: self.rows,
                page_size: self.page,
                heads: self.heads,
                item_bytes: self.items.clone(),
                plane_base: if self.shared() {
                    vec![world.host[0].as_mut_ptr() as u64; self.items.len()]
                } else {
                    world
                        .host
                        .iter_mut()
                        .map(|h| h.as_mut_ptr() as u64)
                        .collect()
                },
            };
            let device = DeviceSide {
                layer_ptrs,
                rows: self.dev_rows,
                row_pitch: self.row_pitch.map(|p| p as u64),
                memory: DeviceMemory::Host,
            };
            let host_idx = IndexArray {
                ptr: hb.as_ptr() as u64,
                len: self.host_idx.len(),
                width: self.width,
                on_device: false,
                map: self.map,
            };
            let dev_idx = IndexArray {
                ptr: db.as_ptr() as u64,
                len: self.dev_idx.len(),
                width: self.width,
                on_device: false,
                map: self.map,
            };
            // SAFETY: every address names a buffer of `world` (planes of L*S*I bytes, device
            // layers of dev_rows*I bytes) or the returned index vectors, of the sizes stated; the
            // caller keeps them alive and unchanged while the request is used, and the request's
            // own vectors are not among them.
            let req = unsafe {
                TransferRequest::new(geom, self.backend, self.op, device, host_idx, dev_idx)
            };
            (req, hb, db)
        }

        /// Host byte offset of plane `plane` from the contract's formulas (host-pool-contract
        /// §2.1; page_unified: SGLang 0.5.23's page_dims).
        fn host_off(&self, plane: usize, item: usize, t: usize, l: usize, h: usize) -> usize {
            let (ll, s, p, hh) = (self.layers, self.rows, self.page, self.heads);
            let ld = ll * item;
            match self.layout {
                Layout::PageUnified => {
                    let (c, gb) = (self.items.len(), item / hh);
                    (t / p) * c * p * ld + (((h * ll + l) * c + plane) * p + t % p) * gb
                }
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
            let heads = if matches!(self.layout, Layout::PageHead | Layout::PageUnified) {
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
                            let ho = self.host_off(pl, item, t, l, h);
                            let dof = d * self.pitch(item) + h * seg;
                            let hb = if self.shared() { 0 } else { pl };
                            let host = &mut w.host[hb][ho..ho + seg];
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
            let plan = build(&req)?;
            let ops = copies(&plan);
            crate::cpu::execute(&plan)?;
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
            map: IndexMap::Identity,
            row_pitch: None,
        }
    }

    const PAIRS: [(Layout, Backend); 7] = [
        (Layout::LayerFirst, Backend::Kernel),
        (Layout::PageFirst, Backend::Kernel),
        (Layout::PageHead, Backend::Kernel),
        (Layout::PageFirstDirect, Backend::Kernel),
        (Layout::LayerFirst, Backend::Direct),
        (Layout::PageFirstDirect, Backend::Direct),
        (Layout::PageUnified, Backend::Kernel),
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
                // page_unified: K and V of one item size, split into `heads` head groups.
                if layout == Layout::PageUnified
                    && (items.iter().any(|&i| i != items[0] || i % heads != 0))
                {
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
                            map: IndexMap::Identity,
                            row_pitch: None,
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
    fn page_rows_read_every_index_of_every_page() {
        // V4 page rows: one row per page, found from the first index of the page; the rest of
        // the page must follow it, or a page nobody listed whole would move.
        let mut c = base_case(Layout::LayerFirst, Backend::Kernel, vec![8]);
        c.map = IndexMap::PageRows { page: 4 };
        c.host_idx = vec![4, 5, 6, 7, 8, 9, 10, 11];
        c.dev_idx = vec![0, 1, 2, 3, 4, 5, 6, 7];
        let mut w = c.world(&mut Rng(1));
        c.run_plan(&mut w).expect("whole pages");
        c.host_idx = vec![4, 5, 6, 1_000_000_000, 8, 9, 10, 11];
        expect_err(
            &c,
            "page 0: host index 1000000000 at position 3 breaks the run 4..8",
        );
        c.host_idx = vec![4, 5, 10, 11, 8, 9, 10, 11];
        expect_err(
            &c,
            "page 0: host index 10 at position 2 breaks the run 4..8",
        );
        c.host_idx = vec![4, 5, 6, 7, 8, 9, 10, 11];
        c.dev_idx = vec![2, 3, 4, 5, 4, 5, 6, 7];
        expect_err(
            &c,
            "page 0: device index 2 at position 0 does not start a page",
        );
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
        assert!(matches!(e, Error::Plan(_)));
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
        assert!(matches!(e, Error::Plan(_)));

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
        assert!(matches!(
            e,
            Error::Layout(crate::error::LayoutError::Unsupported(_))
        ));

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
        let (req, _hb, _db) = c.request(&mut w);
        let mut parts = req.into_parts();
        parts.3.layer_ptrs.pop();
        // SAFETY: the same live buffers, one pointer fewer (refused before any use).
        let req = unsafe { req_from(parts) };
        let e = build(&req).unwrap_err();
        assert!(
            e.to_string().contains("expected 6 device layer pointers"),
            "{e}"
        );

        let (req, hb, _db) = c.request(&mut w);
        let mut parts = req.into_parts();
        parts.5.on_device = true;
        // SAFETY: the same live buffers; "GPU-resident" host memory is allowed for
        // `DeviceMemory::Host`.
        let req = unsafe { req_from(parts.clone_parts()) };
        let e = build(&req).unwrap_err();
        assert!(e.to_string().contains("GPU memory"), "{e}");
        // The CUDA path can still validate the host side alone.
        validate(&req).unwrap();
        parts.4.len = 3;
        // SAFETY: a shorter view of the same live host index buffer `hb`.
        let req = unsafe { req_from(parts) };
        assert!(hb.len() >= 3 * 8 && validate(&req).is_err());

        let (req, _hb, _db) = c.request(&mut w);
        let mut parts = req.into_parts();
        parts.4.ptr = 0;
        // SAFETY: a null index array is refused before any use; the rest is live.
        let req = unsafe { req_from(parts) };
        assert!(build(&req)
            .unwrap_err()
            .to_string()
            .contains("null address"));

        let (req, _hb, _db) = c.request(&mut w);
        let mut parts = req.into_parts();
        parts.3.layer_ptrs[0] = 0;
        // SAFETY: a null layer pointer is refused before any use; the rest is live.
        let req = unsafe { req_from(parts) };
        assert!(build(&req)
            .unwrap_err()
            .to_string()
            .contains("device layer pointer"));

        let (req, _hb, _db) = c.request(&mut w);
        let mut parts = req.into_parts();
        parts.0.plane_base.pop();
        // SAFETY: a missing plane base is refused before any use; the rest is live.
        let req = unsafe { req_from(parts) };
        assert!(matches!(
            build(&req).unwrap_err(),
            Error::Layout(crate::error::LayoutError::Geometry(_))
        ));

        // A request over CUDA memory plans (the direct backend streams its copies) but the CPU
        // engine refuses it.
        let (req, _hb, _db) = c.request(&mut w);
        let mut parts = req.into_parts();
        parts.3.memory = DeviceMemory::Cuda;
        // SAFETY: host buffers standing in for device memory; nothing on the CPU may touch
        // them through this request, and the engine must refuse it.
        let req = unsafe { req_from(parts) };
        let plan = build(&req).unwrap();
        let e = crate::cpu::execute(&plan).unwrap_err();
        assert!(e.to_string().contains("CUDA device memory"), "{e}");
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

    /// Runs `c` four ways on identical worlds and compares each with the reference byte for
    /// byte: `cpu::execute`, `cpu::execute_serial`, `cpu::execute_chunked` with `chunk` units per
    /// chunk (so chunks cut through runs and pages on the worker pool), and the copies of
    /// `for_each_copy` (the CUDA direct backend's producer) applied one by one, taken in chunks
    /// of `chunk` units.
    fn check_every_engine(c: &Case, seed: u64, chunk: usize) {
        let mut rng = Rng(seed | 1);
        let mut want = c.world(&mut rng);
        let before = (want.host.clone(), want.dev.clone());
        c.reference(&mut want);
        for way in 0..4 {
            let mut rng = Rng(seed | 1);
            let mut got = c.world(&mut rng);
            let (req, _hb, _db) = c.request(&mut got);
            let plan = build(&req).unwrap_or_else(|e| panic!("{c:?}: {e}"));
            assert_eq!(
                plan.bytes(),
                (c.host_idx.len() * c.items.iter().sum::<usize>() * c.device_layers()) as u64
            );
            match way {
                0 => crate::cpu::execute(&plan).unwrap(),
                1 => crate::cpu::execute_serial(&plan).unwrap(),
                2 => crate::cpu::execute_chunked(&plan, chunk).unwrap(),
                _ => {
                    let mut lo = 0;
                    while lo < plan.units() {
                        let hi = (lo + chunk).min(plan.units());
                        plan.for_each_copy(lo..hi, |op| {
                            // SAFETY: the plan's copies lie inside the world's buffers, which
                            // are distinct allocations (no overlap).
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    op.src as *const u8,
                                    op.dst as *mut u8,
                                    op.len as usize,
                                )
                            };
                            Ok(())
                        })
                        .unwrap();
                        lo = hi;
                    }
                }
            }
            assert!(got.host == want.host, "way {way}: host bytes differ: {c:?}");
            assert!(got.dev == want.dev, "way {way}: device bytes differ: {c:?}");
        }
        if !c.host_idx.is_empty() {
            assert!(
                (want.host.clone(), want.dev.clone()) != before,
                "{c:?}: the reference moved nothing"
            );
        }
    }

    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }

    /// A random transfer: any (layout, backend) pair, page sizes including non-powers of two,
    /// 1/3/16/656-byte items (one or two planes), 1..=61 layers, heads dividing the items,
    /// int32/int64, backup / one-layer backup / load, indices that are whole shuffled pages
    /// (runs), single shuffled tokens, or nothing.
    fn random_case(rng: &mut Rng) -> Case {
        let (layout, backend) = PAIRS[rng.below(PAIRS.len() as u64) as usize];
        let layers = 1 + rng.below(61) as usize;
        let page = [1usize, 2, 3, 4, 5, 7, 8, 16][rng.below(8) as usize];
        let sizes = [1usize, 3, 16, 656];
        let nplanes = 1 + rng.below(2) as usize;
        let mut items: Vec<usize> = (0..nplanes).map(|_| sizes[rng.below(4) as usize]).collect();
        if layout == Layout::PageUnified {
            items = vec![items[0]; nplanes];
        }
        let heads = if matches!(layout, Layout::PageHead | Layout::PageUnified) {
            let g = items.iter().fold(0, |a, &b| gcd(a, b));
            let divisors: Vec<usize> = (1..=g).filter(|d| g % d == 0).collect();
            divisors[rng.below(divisors.len() as u64) as usize]
        } else {
            1
        };
        // Keep each plane under ~256 KiB (debug builds walk every byte of the reference).
        let max_item = *items.iter().max().unwrap();
        let max_pages = ((256 << 10) / (layers * max_item * page)).clamp(1, 6);
        let rows = page * (1 + rng.below(max_pages as u64) as usize);
        let dev_rows = page * (1 + rng.below(max_pages as u64) as usize);
        let npages_max = rows.min(dev_rows) / page;
        let (host_idx, dev_idx) = match rng.below(5) {
            0 => (vec![], vec![]),
            1 | 2 if backend == Backend::Kernel => {
                // Single tokens, distinct on each side, shuffled.
                let n = 1 + rng.below(rows.min(dev_rows) as u64) as usize;
                let mut h: Vec<i64> = (0..rows as i64).collect();
                let mut d: Vec<i64> = (0..dev_rows as i64).collect();
                rng.shuffle(&mut h);
                rng.shuffle(&mut d);
                (h[..n].to_vec(), d[..n].to_vec())
            }
            _ => {
                let npages = 1 + rng.below(npages_max as u64) as usize;
                paged_indices(rng, rows, dev_rows, page, npages)
            }
        };
        let host_layer = rng.below(layers as u64) as usize;
        // Strided device rows (SGLang's unified pools), except for whole page blocks and
        // page_head (SGLang has no copy of either for them).
        let refused = layout == Layout::PageHead
            || (layout, backend) == (Layout::PageFirstDirect, Backend::Direct);
        let row_pitch =
            (!refused && rng.below(3) == 0).then(|| max_item + [1, 5, 64][rng.below(3) as usize]);
        Case {
            layout,
            backend,
            layers,
            rows,
            page,
            heads,
            items,
            dev_rows,
            host_idx,
            dev_idx,
            width: if rng.below(2) == 0 {
                IndexWidth::I32
            } else {
                IndexWidth::I64
            },
            op: match rng.below(3) {
                0 => Op::Backup,
                1 => Op::BackupLayer { host_layer },
                _ => Op::Load { host_layer },
            },
            map: IndexMap::Identity,
            row_pitch,
        }
    }

    /// Strided K and V layers interleaved in one buffer (SGLang's unified pools) are disjoint
    /// destinations where their rows are, and not where a V row reaches into a K row.
    #[test]
    fn interleaved_strided_layers_are_disjoint_where_their_rows_are() {
        let (item, pitch, rows) = (16usize, 40usize, 8usize);
        let mut host = vec![0u8; 2 * rows * item];
        let mut entries = vec![0u8; rows * pitch];
        let (idx_h, idx_d) = ([0i64, 3], [5i64, 1]);
        let disjoint = |v_offset: usize, entries: &mut [u8], host: &mut [u8]| {
            let base = entries.as_mut_ptr() as u64;
            let index = |v: &[i64]| IndexArray {
                ptr: v.as_ptr() as u64,
                len: v.len(),
                width: IndexWidth::I64,
                on_device: false,
                map: IndexMap::Identity,
            };
            let geom = HostGeometry {
                layout: Layout::LayerFirst,
                layers: 1,
                rows,
                page_size: 1,
                heads: 1,
                item_bytes: vec![item, item],
                plane_base: vec![
                    host.as_mut_ptr() as u64,
                    host.as_mut_ptr() as u64 + (rows * item) as u64,
                ],
            };
            let device = DeviceSide {
                layer_ptrs: vec![base, base + v_offset as u64],
                rows: rows - 1, // the V layer's last row would pass the buffer's end
                row_pitch: Some(pitch as u64),
                memory: DeviceMemory::Host,
            };
            let op = Op::Load { host_layer: 0 };
            // SAFETY: `host`, `entries` (rows of `pitch` bytes, both layers' rows inside it) and
            // the index arrays are live for the request's use and reached only through it.
            let req = unsafe {
                TransferRequest::new(
                    geom,
                    Backend::Kernel,
                    op,
                    device,
                    index(&idx_h),
                    index(&idx_d),
                )
            };
            let plan = build(&req).unwrap();
            crate::cpu::execute(&plan).unwrap();
            plan.disjoint()
        };
        assert!(disjoint(item, &mut entries, &mut host)); // V right after K
        assert!(disjoint(item + 8, &mut entries, &mut host)); // with a gap
        assert!(!disjoint(item - 1, &mut entries, &mut host)); // V's first byte is K's last
        assert!(!disjoint(pitch - item + 1, &mut entries, &mut host)); // V reaches the next K
    }

    /// Property test: the compact plan, run by every engine and split every way, moves exactly
    /// the bytes the contract's formulas say, for random geometries.
    #[test]
    fn random_geometries_match_the_reference_on_every_engine() {
        let mut rng = Rng(0x5151_2024_0013);
        let mut seen = std::collections::HashSet::new();
        let mut strided = std::collections::HashSet::new();
        for _ in 0..400 {
            let c = random_case(&mut rng);
            let units = match (c.layout, c.backend) {
                (Layout::PageFirstDirect, Backend::Direct) => {
                    c.host_idx.len() / c.page * c.items.len() * c.device_layers()
                }
                _ => c.host_idx.len(),
            };
            let chunk = 1 + rng.below(units.max(1) as u64) as usize;
            check_every_engine(&c, rng.next(), chunk);
            seen.insert((
                c.layout,
                c.backend,
                c.width == IndexWidth::I32,
                c.op.to_host(),
            ));
            if c.row_pitch.is_some() {
                strided.insert((c.layout, c.backend));
            }
        }
        // Every pair, with both widths and both directions; strided device rows with every
        // pair but the page blocks and page_head.
        assert_eq!(seen.len(), PAIRS.len() * 2 * 2, "{seen:?}");
        assert_eq!(strided.len(), PAIRS.len() - 2, "{strided:?}");
        // Strided device rows cannot be page blocks (SGLang's refusal), nor closer than a row.
        let mut c = base_case(Layout::PageFirstDirect, Backend::Direct, vec![16]);
        (c.host_idx, c.dev_idx) = ((0..c.page as i64).collect(), (0..c.page as i64).collect());
        c.row_pitch = Some(32);
        let e = c
            .run_plan(&mut c.world(&mut Rng(3)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("transfer_kv_all_layer_direct_lf_pf steps device rows by the row width (16 B), but this device pool's rows are 32 B apart"), "{e}");
        // Nor page_head, in either direction (SGLang refuses it wherever it runs).
        for op in [Op::Backup, Op::Load { host_layer: 0 }] {
            let mut c = base_case(Layout::PageHead, Backend::Kernel, vec![16]);
            (c.host_idx, c.dev_idx, c.op) = (vec![0, 1, 2, 3], vec![4, 5, 6, 7], op);
            c.row_pitch = Some(32);
            let e = c
                .run_plan(&mut c.world(&mut Rng(3)))
                .unwrap_err()
                .to_string();
            let kernel = if op.to_host() {
                "transfer_kv_all_layer_lf_ph"
            } else {
                "transfer_kv_per_layer_ph_lf"
            };
            assert!(e.contains(&format!("HiCache: {kernel} steps device rows by the row width (16 B), but this device pool's rows are 32 B apart")), "{e}");
        }
        c.backend = Backend::Kernel;
        c.row_pitch = Some(15);
        let e = c
            .run_plan(&mut c.world(&mut Rng(3)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("device rows 15 bytes apart cannot hold rows of 16 bytes"),
            "{e}"
        );
        // Direct + page_first / page_head have no plan: refused before anything moves.
        for layout in [Layout::PageFirst, Layout::PageHead] {
            let mut c = base_case(layout, Backend::Direct, vec![16]);
            c.host_idx = vec![0, 1, 2, 3];
            c.dev_idx = vec![4, 5, 6, 7];
            let e = expect_err(&c, "Unsupported layout");
            assert!(matches!(
                e,
                Error::Layout(crate::error::LayoutError::Unsupported(_))
            ));
        }
    }

    /// A changed index array (forbidden by `TransferRequest::new`, done here between
    /// validation and the copy, on this thread) stops the walk with an error instead of
    /// leaving the pools.
    #[test]
    fn an_index_changed_after_validation_is_caught_by_the_walk() {
        for (layout, backend) in PAIRS {
            let items = if layout == Layout::PageUnified {
                vec![8, 8]
            } else {
                vec![8, 4]
            };
            let mut c = base_case(layout, backend, items);
            c.host_idx = vec![4, 5, 6, 7];
            c.dev_idx = vec![0, 1, 2, 3];
            let mut rng = Rng(9);
            let mut w = c.world(&mut rng);
            let (req, mut hb, _db) = c.request(&mut w);
            let plan = build(&req).unwrap();
            // Position 0 now names row 16 of a 16-row pool.
            hb[..8].copy_from_slice(&16i64.to_ne_bytes());
            let e = crate::cpu::execute(&plan).unwrap_err();
            assert!(
                e.to_string()
                    .contains("host index 16 at position 0 changed while the transfer ran"),
                "{layout:?} {backend:?}: {e}"
            );
            let e = plan.for_each_copy(0..plan.units(), |_| Ok(())).unwrap_err();
            assert!(e.to_string().contains("changed"), "{e}");
        }
    }

    /// An index array stored in the bytes a transfer writes (the host planes of a backup, the
    /// device layer of a load) is refused before anything is read; one in bytes the transfer
    /// only reads is not.
    #[test]
    fn an_index_array_in_the_written_bytes_is_refused() {
        for op in [Op::Backup, Op::Load { host_layer: 1 }] {
            let mut c = base_case(Layout::PageFirst, Backend::Kernel, vec![8, 4]);
            c.host_idx = vec![4, 5, 6, 7];
            c.dev_idx = vec![0, 1, 2, 3];
            c.op = op;
            let mut w = c.world(&mut Rng(3));
            let (req, hb, db) = c.request(&mut w);
            let (geom, backend, op, device, mut host_idx, mut dev_idx) = req.into_parts();
            let (host_end, dev_end) = (w.host[1].len() - hb.len(), w.dev[1][0].len() - db.len());
            // The last bytes of the second plane (host) or of its device layer hold the values.
            w.host[1][host_end..].copy_from_slice(&hb);
            w.dev[1][0][dev_end..].copy_from_slice(&db);
            let (in_host, in_dev) = (
                w.host[1][host_end..].as_ptr() as u64,
                w.dev[1][0][dev_end..].as_ptr() as u64,
            );
            let written_side = if op.to_host() {
                host_idx.ptr = in_host;
                "host index array lies in the host pool"
            } else {
                dev_idx.ptr = in_dev;
                "device index array lies in the device layer"
            };
            // SAFETY: the same buffers as `c.request`'s, the moved index array now inside one of
            // `w`'s (alive and unchanged for the check, which reads no index).
            let req = unsafe { TransferRequest::new(geom, backend, op, device, host_idx, dev_idx) };
            let e = check_structure(&req).unwrap_err();
            assert!(e.to_string().contains(written_side), "{op:?}: {e}");
            // Stored on the side it only reads, the same array passes.
            let (geom, backend, op, device, mut host_idx, mut dev_idx) = req.into_parts();
            (host_idx.ptr, dev_idx.ptr) = (hb.as_ptr() as u64, db.as_ptr() as u64);
            if op.to_host() {
                dev_idx.ptr = in_dev;
            } else {
                host_idx.ptr = in_host;
            }
            // SAFETY: as above.
            let req = unsafe { TransferRequest::new(geom, backend, op, device, host_idx, dev_idx) };
            check_structure(&req).unwrap();
        }
    }

    /// A sink error stops the walk at once and comes back unchanged.
    #[test]
    fn for_each_copy_stops_at_the_first_sink_error() {
        let mut c = base_case(Layout::PageFirst, Backend::Kernel, vec![8]);
        c.host_idx = vec![1, 3, 5, 7];
        c.dev_idx = vec![0, 2, 4, 6];
        let mut rng = Rng(4);
        let mut w = c.world(&mut rng);
        let (req, _hb, _db) = c.request(&mut w);
        let plan = build(&req).unwrap();
        let mut calls = 0;
        let e = plan
            .for_each_copy(0..plan.units(), |_| {
                calls += 1;
                if calls == 3 {
                    Err(Error::cuda("stop"))
                } else {
                    Ok(())
                }
            })
            .unwrap_err();
        assert_eq!((e.to_string().as_str(), calls), ("stop", 3));
    }

    /// proptest over the planner: arbitrary (layout, backend) pairs, geometries (page sizes that
    /// are not powers of two, one or two planes, heads that may not divide the item), ops, index
    /// widths and index values (in range, out of range, negative, repeated, broken page runs,
    /// mismatched lengths). An independent oracle, written from the contract, says whether the
    /// request is valid; `build` must agree, an accepted transfer must move exactly the
    /// reference's bytes, and a refused one must move nothing.
    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Whether the contract accepts `c` (host-pool-contract §2-3, transfer-semantics §2.6).
        fn oracle_valid(c: &Case) -> bool {
            let heads = if matches!(c.layout, Layout::PageHead | Layout::PageUnified) {
                c.heads
            } else {
                1
            };
            if c.items.iter().any(|i| i % heads != 0) {
                return false;
            }
            if c.layout == Layout::PageUnified && c.items.iter().any(|&i| i != c.items[0]) {
                return false;
            }
            let whole_pages = matches!(
                c.layout,
                Layout::PageFirstDirect | Layout::PageHead | Layout::PageUnified
            );
            if whole_pages && c.rows % c.page != 0 {
                return false;
            }
            if c.backend == Backend::Direct
                && matches!(
                    c.layout,
                    Layout::PageFirst | Layout::PageHead | Layout::PageUnified
                )
            {
                return false;
            }
            if let Op::BackupLayer { host_layer } | Op::Load { host_layer } = c.op {
                if host_layer >= c.layers {
                    return false;
                }
            }
            let n = c.host_idx.len();
            if n != c.dev_idx.len() {
                return false;
            }
            let per_item = c.backend == Backend::Kernel;
            if !per_item && n % c.page != 0 {
                return false;
            }
            let in_range =
                |v: &[i64], bound: usize| v.iter().all(|&x| x >= 0 && (x as usize) < bound);
            if !in_range(&c.host_idx, c.rows) || !in_range(&c.dev_idx, c.dev_rows) {
                return false;
            }
            if c.backend == Backend::Direct && c.layout == Layout::PageFirstDirect {
                // Whole pages: the host page starts at a page boundary and both sides are runs
                // of `page` consecutive rows.
                let p = c.page;
                return (0..n / p).all(|k| {
                    let h = &c.host_idx[k * p..][..p];
                    let d = &c.dev_idx[k * p..][..p];
                    h[0] as usize % p == 0
                        && (0..p).all(|j| h[j] == h[0] + j as i64 && d[j] == d[0] + j as i64)
                });
            }
            true
        }

        /// Index vectors: arbitrary small values (mostly refused), valid whole pages with one
        /// position perhaps disturbed, or distinct single tokens.
        fn indices(
            seed: u64,
            mode: u8,
            rows: usize,
            dev_rows: usize,
            page: usize,
            arbitrary: (Vec<i64>, Vec<i64>),
        ) -> (Vec<i64>, Vec<i64>) {
            let mut rng = Rng(seed | 1);
            match mode {
                0 => arbitrary,
                1 | 2 => {
                    let max = rows.min(dev_rows) / page;
                    if max == 0 {
                        return (vec![], vec![]);
                    }
                    let npages = 1 + rng.below(max as u64) as usize;
                    let (mut h, mut d) = paged_indices(&mut rng, rows, dev_rows, page, npages);
                    if mode == 2 {
                        // Disturb one position (a broken run, a repeat, a value just past the
                        // end) or shift one whole page by a row (a misaligned but unbroken run).
                        let at = rng.below(h.len() as u64) as usize;
                        let side = if rng.below(2) == 0 { &mut h } else { &mut d };
                        match rng.below(5) {
                            0 => side[at] += 1,
                            1 => side[at] -= 1,
                            2 => side[at] = side[0],
                            3 => side[at] = rows.max(dev_rows) as i64,
                            _ => {
                                let k = at / page * page;
                                side[k..k + page].iter_mut().for_each(|v| *v += 1);
                            }
                        }
                    }
                    (h, d)
                }
                _ => {
                    let n = rows.min(dev_rows);
                    let mut h: Vec<i64> = (0..rows as i64).collect();
                    let mut d: Vec<i64> = (0..dev_rows as i64).collect();
                    rng.shuffle(&mut h);
                    rng.shuffle(&mut d);
                    let k = rng.below(n as u64 + 1) as usize;
                    (h[..k].to_vec(), d[..k].to_vec())
                }
            }
        }

        /// The values a transfer reads through `map`, written from SGLang's expressions
        /// (`idx[rank::size] // size`, `idx[::P] // P`, the C4 value row), or None when the raw
        /// array is not made of whole groups.
        fn oracle_map(map: IndexMap, raw: &[i64]) -> Option<Vec<i64>> {
            let floor = |a: i64, b: i64| (a as f64 / b as f64).floor() as i64;
            match map {
                IndexMap::Identity => Some(raw.to_vec()),
                // The share of any run; 0.5.18-0.5.19's form only of whole widened pages.
                IndexMap::Dcp { size, rank } | IndexMap::DcpShare { size, rank } => {
                    let s = size as usize;
                    let whole = matches!(map, IndexMap::Dcp { .. });
                    (!whole || raw.len() % s == 0).then(|| {
                        raw.iter()
                            .skip(rank as usize)
                            .step_by(s)
                            .map(|&t| floor(t, s as i64))
                            .collect()
                    })
                }
                IndexMap::PageRows { page } => {
                    // Every page whole: its first index on a page boundary, the rest following.
                    let p = page as usize;
                    let whole = raw.len() % p == 0
                        && raw.chunks(p).all(|g| {
                            g[0].rem_euclid(p as i64) == 0
                                && g.iter().enumerate().all(|(j, &t)| t == g[0] + j as i64)
                        });
                    whole.then(|| raw.iter().step_by(p).map(|&t| floor(t, p as i64)).collect())
                }
                IndexMap::C4Value => Some(
                    raw.iter()
                        .map(|&t| floor(t, 64) * 65 + (t - floor(t, 64) * 64))
                        .collect(),
                ),
                IndexMap::C4Scale => None, // not drawn: its rows lie past these small pools
            }
        }

        /// `c` with its mapped values and no map (what the reference and the validity oracle
        /// read), or None when the map refuses the raw arrays.
        fn shadow(c: &Case) -> Option<Case> {
            let h = oracle_map(c.map, &c.host_idx)?;
            let d = oracle_map(c.map, &c.dev_idx)?;
            Some(Case {
                host_idx: h,
                dev_idx: d,
                map: IndexMap::Identity,
                row_pitch: None,
                ..c.clone()
            })
        }

        /// A raw array whose `(rank, group)` elements map back to `v` under a floor-division
        /// share of `group`: element `rank + i * group` is `v[i] * group + r` (r < group, from
        /// `seed`), the others arbitrary (possibly negative: never read). A trailing partial group
        /// sometimes, so the map refuses it.
        fn spread(v: &[i64], group: u32, rank: u32, seed: u64) -> Vec<i64> {
            let g = group as usize;
            let mut rng = Rng(seed | 1);
            let mut out = vec![0i64; v.len() * g];
            for (i, x) in out.iter_mut().enumerate() {
                *x = rng.below(100) as i64 - 7;
                if i % g == rank as usize {
                    let r = if g > 1 { rng.below(g as u64) as i64 } else { 0 };
                    *x = v[i / g] * group as i64 + r;
                }
            }
            if rng.below(8) == 0 {
                out.push(1);
            }
            out
        }

        /// Whole pages of token slots for page rows `v` (row `r` is slots `r*P .. r*P+P`); one
        /// case in eight breaks a run or leaves a partial page, so the check is exercised.
        fn whole_pages(v: &[i64], page: u32, seed: u64) -> Vec<i64> {
            let p = page as i64;
            let mut rng = Rng(seed | 1);
            let mut out: Vec<i64> = v
                .iter()
                .flat_map(|&r| (0..p).map(move |j| r * p + j))
                .collect();
            match rng.below(16) {
                0 if !out.is_empty() => {
                    let at = rng.below(out.len() as u64) as usize;
                    out[at] += 1 + rng.below(3) as i64;
                }
                1 => out.push(1),
                _ => {}
            }
            out
        }

        fn distinct(v: &[i64]) -> bool {
            let mut s = v.to_vec();
            s.sort_unstable();
            s.windows(2).all(|w| w[0] != w[1])
        }

        prop_compose! {
            fn any_case()(
                pair in 0usize..PAIRS.len(),
                layers in 1usize..=6,
                page in prop::sample::select(vec![1usize, 2, 3, 4, 5, 7, 8]),
                items in prop::collection::vec(prop::sample::select(vec![1usize, 3, 16, 24]), 1..=2),
                heads in 1usize..=8,
                host_pages in 0usize..=4,
                dev_pages in 0usize..=4,
                ragged in prop::bool::weighted(0.1),
                op in 0u8..3,
                layer in 0usize..8,
                wide in any::<bool>(),
                mode in 0u8..4,
                map_kind in 0u8..8,
                seed in any::<u64>(),
                arb_h in prop::collection::vec(-2i64..40, 0..24),
                arb_d in prop::collection::vec(-2i64..40, 0..24),
            ) -> Case {
                let (layout, backend) = PAIRS[pair];
                let rows = host_pages * page + usize::from(ragged);
                let dev_rows = dev_pages * page + 3;
                let (host_idx, dev_idx) = indices(seed, mode, rows, dev_rows, page, (arb_h, arb_d));
                let map = match map_kind {
                    0..=3 => IndexMap::Identity,
                    4 => IndexMap::Dcp { size: 2, rank: (seed >> 7) as u32 & 1 },
                    5 if seed & 1 == 0 => IndexMap::Dcp { size: 3, rank: (seed >> 7) as u32 % 3 },
                    5 => IndexMap::DcpShare { size: 3, rank: (seed >> 7) as u32 % 3 },
                    6 => IndexMap::PageRows { page: page as u32 },
                    _ => IndexMap::C4Value,
                };
                // Under a map, raw arrays are drawn from the mapped ones' inverse images where
                // there is one, so that mapped transfers are valid often enough to be checked.
                let (host_idx, dev_idx) = match map {
                    IndexMap::Dcp { size, rank } => (
                        spread(&host_idx, size, rank, seed),
                        spread(&dev_idx, size, rank, seed >> 3),
                    ),
                    IndexMap::PageRows { page } => (
                        whole_pages(&host_idx, page, seed),
                        whole_pages(&dev_idx, page, seed >> 3),
                    ),
                    _ => (host_idx, dev_idx),
                };
                Case {
                    layout,
                    backend,
                    layers,
                    rows,
                    page,
                    heads,
                    items,
                    dev_rows,
                    host_idx,
                    dev_idx,
                    width: if wide { IndexWidth::I64 } else { IndexWidth::I32 },
                    op: match op {
                        0 => Op::Backup,
                        1 => Op::BackupLayer { host_layer: layer },
                        _ => Op::Load { host_layer: layer },
                    },
                    map,
                    row_pitch: None,
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 3000,
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            #[test]
            fn the_planner_accepts_exactly_valid_requests_and_moves_exactly_their_bytes(
                c in any_case(),
                seed in any::<u64>(),
            ) {
                let shadow_case = shadow(&c);
                let valid = shadow_case.as_ref().is_some_and(oracle_valid);
                let mut rng = Rng(seed | 1);
                let mut got = c.world(&mut rng);
                let before = (got.host.clone(), got.dev.clone());
                let result = c.run_plan(&mut got);
                prop_assert_eq!(result.is_ok(), valid, "{:?}: {:?}", c, result.err());
                if !valid {
                    prop_assert!(got.host == before.0 && got.dev == before.1, "refused but wrote: {:?}", c);
                    return Ok(());
                }
                let s = shadow_case.expect("valid implies mapped");
                let (dst, src_unchanged) = if c.op.to_host() {
                    (&s.host_idx, got.dev == before.1)
                } else {
                    (&s.dev_idx, got.host == before.0)
                };
                prop_assert!(src_unchanged, "the source side changed: {:?}", c);
                if distinct(dst) {
                    let mut want = World { host: before.0, dev: before.1 };
                    s.reference(&mut want);
                    prop_assert!(got.host == want.host && got.dev == want.dev, "bytes differ: {:?}", c);
                }
            }
        }
    }
}

/// A global allocator that counts live heap bytes and their peak, for the footprint test. Only
/// the lib's unit-test binary has it.
#[cfg(test)]
mod counting_alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicIsize, Ordering};

    static LIVE: AtomicIsize = AtomicIsize::new(0);
    static PEAK: AtomicIsize = AtomicIsize::new(0);

    pub struct Counting;

    fn grew(by: isize) {
        let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }

    // SAFETY: every call is forwarded to `System` with the caller's arguments; the counters are
    // atomics and allocate nothing.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            grew(layout.size() as isize);
            // SAFETY: the caller's contract for `alloc`, passed on.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            grew(layout.size() as isize);
            // SAFETY: as above.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            grew(new_size as isize - layout.size() as isize);
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// Starts a measurement: the peak becomes the bytes live now, which are returned.
    pub fn start() -> isize {
        let now = LIVE.load(Ordering::Relaxed);
        PEAK.store(now, Ordering::Relaxed);
        now
    }

    /// Highest live heap bytes since `start`.
    pub fn peak() -> isize {
        PEAK.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod footprint_tests {
    use super::counting_alloc;
    use super::*;
    use crate::request::Backend;
    use crate::request::{DeviceSide, HostGeometry};

    /// One transfer over freshly allocated pools: `(layout, backend, layers, rows, page, heads,
    /// item bytes per plane, op)`, host rows `from` -> device rows `to` (or back for a backup).
    struct Pools {
        host: Vec<Vec<u8>>,
        dev: Vec<Vec<u8>>,
        from: Vec<i32>,
        to: Vec<i64>,
        req: Option<TransferRequest>,
    }

    #[allow(clippy::too_many_arguments)]
    fn pools(
        layout: Layout,
        backend: Backend,
        layers: usize,
        rows: usize,
        page: usize,
        heads: usize,
        items: &[usize],
        op: Op,
        from: Vec<i32>,
        to: Vec<i64>,
    ) -> Pools {
        let dev_layers = if op == Op::Backup { layers } else { 1 };
        let mut p = Pools {
            host: items
                .iter()
                .map(|&i| vec![1u8; layers * rows * i])
                .collect(),
            dev: items
                .iter()
                .flat_map(|&i| (0..dev_layers).map(move |_| vec![2u8; rows * i]))
                .collect(),
            from,
            to,
            req: None,
        };
        let geom = HostGeometry {
            layout,
            layers,
            rows,
            page_size: page,
            heads,
            item_bytes: items.to_vec(),
            plane_base: p.host.iter_mut().map(|h| h.as_mut_ptr() as u64).collect(),
        };
        let device = DeviceSide {
            layer_ptrs: p.dev.iter_mut().map(|d| d.as_mut_ptr() as u64).collect(),
            rows,
            row_pitch: None,
            memory: DeviceMemory::Host,
        };
        let host_idx = IndexArray {
            ptr: p.from.as_ptr() as u64,
            len: p.from.len(),
            width: IndexWidth::I32,
            on_device: false,
            map: crate::request::IndexMap::Identity,
        };
        let dev_idx = IndexArray {
            ptr: p.to.as_ptr() as u64,
            len: p.to.len(),
            width: IndexWidth::I64,
            on_device: false,
            map: crate::request::IndexMap::Identity,
        };
        // SAFETY: planes of L*S*I bytes, device layers of S*I bytes and the two index vectors,
        // all owned by `p` (their heap buffers do not move with `p`), alive and untouched while
        // the request (dropped first, see `Drop`) exists.
        p.req = Some(unsafe { TransferRequest::new(geom, backend, op, device, host_idx, dev_idx) });
        p
    }

    impl Drop for Pools {
        fn drop(&mut self) {
            self.req = None;
        }
    }

    /// Peak extra heap bytes of `plan::build` + `cpu::execute` for the request (run twice, the
    /// second measured: the first starts the worker pool), and the bytes it moves.
    fn measure(p: &Pools) -> (isize, u64) {
        let req = p.req.as_ref().unwrap();
        crate::cpu::execute(&build(req).unwrap()).unwrap();
        let base = counting_alloc::start();
        let plan = build(req).unwrap();
        crate::cpu::execute(&plan).unwrap();
        (counting_alloc::peak() - base, plan.bytes())
    }

    /// Runs `f` in a forked child (the only thread there, so the global counter sees this
    /// transfer alone) and fails if it panicked.
    fn in_child(f: impl FnOnce()) {
        // SAFETY: the child runs `f` (allocation works after fork with glibc) and exits with
        // `_exit`, never returning into the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_ok();
            // SAFETY: ends the child without running the parent's atexit handlers twice.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the measuring child failed ({status}); run with --nocapture for its message"
        );
    }

    /// Whole pages in a shuffled order, tokens ascending within a page.
    fn shuffled_pages(rows: usize, page: usize) -> Vec<i32> {
        let pages = rows / page;
        let step = (pages / 2 + 1) | 1;
        (0..pages)
            .flat_map(|k| {
                let hp = (k * step) % pages;
                (0..page).map(move |r| (hp * page + r) as i32)
            })
            .collect()
    }

    /// Issue 13: a page_head backup with 16-byte head segments made one 24-byte record per
    /// segment (1.5x the bytes moved). The plan now holds none: the extra heap of a transfer is
    /// the parallel job record at most, far under 1% of what it moves, for every strategy and
    /// down to 1-byte items; a small (serial) transfer allocates nothing at all.
    #[test]
    fn a_transfer_allocates_under_one_percent_of_what_it_moves() {
        in_child(|| {
            let rows = 4096;
            let to: Vec<i64> = (0..rows as i64).collect();
            let cases = [
                // The issue's case: 8 heads x 16 bytes, 32 layers, K and V: 32 MiB.
                pools(
                    Layout::PageHead,
                    Backend::Kernel,
                    32,
                    rows,
                    64,
                    8,
                    &[128, 128],
                    Op::Backup,
                    shuffled_pages(rows, 64),
                    to.clone(),
                ),
                // 1-byte items, 61 layers: one copy per byte.
                pools(
                    Layout::PageFirst,
                    Backend::Kernel,
                    61,
                    80_000,
                    1,
                    1,
                    &[1],
                    Op::Backup,
                    shuffled_pages(80_000, 1),
                    (0..80_000).collect(),
                ),
                // Direct runs of one row each (3-byte rows), every layer.
                pools(
                    Layout::LayerFirst,
                    Backend::Direct,
                    61,
                    rows,
                    1,
                    1,
                    &[3, 16],
                    Op::Backup,
                    shuffled_pages(rows, 1),
                    to.clone(),
                ),
                // Page blocks of 3 rows of 656 bytes.
                pools(
                    Layout::PageFirstDirect,
                    Backend::Direct,
                    7,
                    3 * 1000,
                    3,
                    1,
                    &[656],
                    Op::Backup,
                    shuffled_pages(3 * 1000, 3),
                    (0..3000).collect(),
                ),
            ];
            for (k, p) in cases.iter().enumerate() {
                let (extra, bytes) = measure(p);
                eprintln!("case {k}: {bytes} bytes moved, {extra} bytes of heap at peak");
                // Large enough for every thread of the pool (`cpu::threads_for`).
                assert!(bytes >= 4 << 20, "case {k} should run in parallel");
                assert!(
                    (extra as u64) * 100 < bytes,
                    "case {k}: {extra} extra bytes for {bytes} moved"
                );
                assert!(extra < 4096, "case {k}: {extra} extra bytes");
            }
            // One index, one 1-byte item, one layer: no allocation at all.
            let tiny = pools(
                Layout::LayerFirst,
                Backend::Kernel,
                1,
                8,
                1,
                1,
                &[1],
                Op::Load { host_layer: 0 },
                vec![5],
                vec![2],
            );
            assert_eq!(measure(&tiny), (0, 1));
        });
    }

    /// `(VmRSS, VmHWM)` of this process in KiB.
    fn rss_kib() -> (i64, i64) {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(-1)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Resets this process's peak RSS (VmHWM) to its current RSS (Linux `clear_refs` 5).
    fn reset_peak_rss() {
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }

    /// Issue 22: the CPU engine with streaming stores against ordinary stores, a one-thread
    /// memcpy of the same bytes and a one-thread streaming copy of them, interleaved round by
    /// round; prints per-round ratios (min, median):
    /// `cargo test --release --lib issue_22_streaming_stores_side_by_side -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement (~600 MiB, seconds): run it with --ignored --nocapture"]
    fn issue_22_streaming_stores_side_by_side() {
        use crate::cpu::{execute_with, Stores};
        let shuffled = |rows: usize, page: usize| -> Vec<i32> {
            let pages = rows / page;
            (0..pages)
                .flat_map(|k| {
                    let hp = (k * 389) % pages;
                    (0..page).map(move |r| (hp * page + r) as i32)
                })
                .collect()
        };
        // (name, layout, layers, rows, page, heads, item, op)
        let cases = [
            (
                "mha page_first backup 8L x 64 pages, 2 KiB",
                Layout::PageFirst,
                8,
                4096,
                64,
                1,
                2048,
                Op::Backup,
            ),
            (
                "mha page_first load 64 pages, 2 KiB",
                Layout::PageFirst,
                8,
                4096,
                64,
                1,
                2048,
                Op::Load { host_layer: 3 },
            ),
            (
                "mha layer_first backup 8L x 64 pages, 2 KiB",
                Layout::LayerFirst,
                8,
                4096,
                64,
                1,
                2048,
                Op::Backup,
            ),
            (
                "mha page_head backup 8L x 64 pages, 8 x 256 B",
                Layout::PageHead,
                8,
                4096,
                64,
                8,
                2048,
                Op::Backup,
            ),
            (
                "mha page_head load 64 pages, 8 x 256 B",
                Layout::PageHead,
                8,
                4096,
                64,
                8,
                2048,
                Op::Load { host_layer: 3 },
            ),
            (
                "mla page_first backup 61L x 8 pages, 1152 B",
                Layout::PageFirst,
                61,
                512,
                64,
                1,
                1152,
                Op::Backup,
            ),
        ];
        for (name, layout, layers, rows, page, heads, item, op) in cases {
            let items: &[usize] = if item == 1152 { &[item] } else { &[item, item] };
            let p = pools(
                layout,
                Backend::Kernel,
                layers,
                rows,
                page,
                heads,
                items,
                op,
                shuffled(rows, page),
                (0..rows as i64).collect(),
            );
            let req = p.req.as_ref().unwrap();
            let bytes = build(req).unwrap().bytes() as usize;
            let src = vec![3u8; bytes];
            let mut dst = vec![0u8; bytes];
            let time = |f: &mut dyn FnMut()| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            };
            let mut ratios: [Vec<f64>; 3] = Default::default();
            let mut best = [f64::MAX; 4];
            for _ in 0..9 {
                let t_nt = time(&mut || execute_with(&build(req).unwrap(), Stores::Auto).unwrap());
                let t_ord =
                    time(&mut || execute_with(&build(req).unwrap(), Stores::Ordinary).unwrap());
                let t_memcpy = time(&mut || dst.copy_from_slice(&src));
                let t_stream = time(&mut || crate::cpu::copy_streaming_fenced(&src, &mut dst));
                for (k, t) in [t_nt, t_ord, t_memcpy, t_stream].into_iter().enumerate() {
                    best[k] = best[k].min(t);
                }
                ratios[0].push(t_ord / t_nt);
                ratios[1].push(t_memcpy / t_nt);
                ratios[2].push(t_stream / t_nt);
            }
            let stat = |v: &mut Vec<f64>| {
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                (v[0], v[v.len() / 2])
            };
            let gbs = |t: f64| bytes as f64 / t / 1e9;
            let (a, b, c) = (
                stat(&mut ratios[0]),
                stat(&mut ratios[1]),
                stat(&mut ratios[2]),
            );
            eprintln!(
                "{name}: {} MiB; best GB/s: streaming {:.2}, ordinary {:.2}, memcpy {:.2}, \
                 NT copy {:.2}; per-round speed of streaming vs ordinary {:.2}/{:.2}x, vs \
                 memcpy {:.2}/{:.2}x, vs NT copy {:.2}/{:.2}x (min/median)",
                bytes >> 20,
                gbs(best[0]),
                gbs(best[1]),
                gbs(best[2]),
                gbs(best[3]),
                a.0,
                a.1,
                b.0,
                b.1,
                c.0,
                c.1
            );
        }
    }

    /// Issue 13's measurement at full size: a 512 MiB page_head backup with 16-byte head
    /// segments (8 heads, 32 layers, K and V, host pages shuffled). Prints the time of
    /// `plan::build` + `cpu::execute` and the growth of peak RSS and of the heap. Needs ~1.1 GiB:
    /// `cargo test --release --lib issue_13_page_head_backup_512_mib -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement (1.1 GiB, seconds): run it with --ignored --nocapture"]
    fn issue_13_page_head_backup_512_mib() {
        let (layers, page, heads, seg, rows) = (32usize, 64usize, 8usize, 16usize, 65_536usize);
        let pages = rows / page;
        let from: Vec<i32> = (0..pages)
            .flat_map(|k| {
                let hp = (k * 389) % pages;
                (0..page).map(move |r| (hp * page + r) as i32)
            })
            .collect();
        let p = pools(
            Layout::PageHead,
            Backend::Kernel,
            layers,
            rows,
            page,
            heads,
            &[heads * seg, heads * seg],
            Op::Backup,
            from,
            (0..rows as i64).collect(),
        );
        let req = p.req.as_ref().unwrap();
        for (name, serial) in [("cpu::execute", false), ("cpu::execute_serial", true)] {
            let mut best = f64::MAX;
            for round in 0..3 {
                reset_peak_rss();
                let (rss, _) = rss_kib();
                let heap = counting_alloc::start();
                let t = std::time::Instant::now();
                let plan = build(req).unwrap();
                if serial {
                    crate::cpu::execute_serial(&plan).unwrap();
                } else {
                    crate::cpu::execute(&plan).unwrap();
                }
                let secs = t.elapsed().as_secs_f64();
                let heap_peak = counting_alloc::peak() - heap;
                let rss_peak = rss_kib().1 - rss;
                best = best.min(secs);
                eprintln!(
                    "{name} round {round}: {} MiB moved in {secs:.3} s; peak RSS +{} KiB, heap \
                     peak +{} B",
                    plan.bytes() >> 20,
                    rss_peak,
                    heap_peak
                );
            }
            eprintln!("{name}: best {best:.3} s");
        }
        // Page_head backup copies every (token, head, layer) segment: spot-check one.
        let item = heads * seg;
        let t = p.from[100] as usize;
        let (l, h) = (7usize, 3usize);
        let at = (t / page) * page * layers * item
            + h * page * layers * seg
            + (t % page) * layers * seg
            + l * seg;
        assert_eq!(
            p.host[1][at..at + seg],
            p.dev[layers + l][100 * item + h * seg..][..seg]
        );
    }
}
