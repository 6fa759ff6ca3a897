//! `_core.HostPool`: one host pool's planes, the spec they follow, and the transfers between them
//! and device layers.

use pyo3::prelude::*;

#[cfg(feature = "raw-calls")]
use super::args;
use super::errors::{to_py, transfer_err, value_err};
use super::extent;
use super::memory::{host_memory, HostMemory, StorageWatch};
use super::page_watch::{self, PageWatch};
#[cfg(feature = "raw-calls")]
use super::raw::IndexArg;
use super::spec::PyPoolSpec;
use crate::digest;
use crate::engine::{CopyEngine, Unlock};
use crate::layout::PlaneLayout;
use crate::request::{
    Backend, DeviceSide, HostGeometry, IndexArray, IndexMap, Layout, Op, TransferRequest,
};

/// Lets the engines run long work without the GIL.
pub(crate) struct Gil<'py>(pub(crate) Python<'py>);

impl Unlock for Gil<'_> {
    fn unlocked(&self, work: &mut (dyn FnMut() -> crate::Result<()> + Send)) -> crate::Result<()> {
        self.0.detach(work)
    }
}

/// One host pool: its spec, its planes' memory and the transfers between them and device layers
/// (1 or 2 planes).
#[pyclass(frozen, module = "hostkv_rs._core", name = "HostPool")]
pub struct PyHostPool {
    pub(crate) geom: HostGeometry,
    planes: Vec<PlaneLayout>,
    /// The spec this pool was built from (`HostPool(spec, allocations)`: its memory was checked
    /// against the spec's planes), which its pair checks and page questions answer by. None for
    /// a geometry built row by row (`from_geometry`).
    pub(crate) spec: Option<Py<PyPoolSpec>>,
    /// What keeps each plane's memory alive (see `memory`); never read, only held.
    _owners: Vec<Py<PyAny>>,
    /// The torch storages planes lie in, by plane (none for `HostRegion` memory mapped by the
    /// core): checked before every use of the planes' bytes.
    storages: Vec<(usize, StorageWatch)>,
    /// The digests of its pages, for a pool built with `watch_pages` (`HOSTKV_PAGE_DIGEST`).
    watch: Option<PageWatch>,
}

impl PyHostPool {
    /// Checks each plane's memory against its layout and keeps its owner.
    fn with_memory(
        geom_of: impl FnOnce(Vec<u64>) -> HostGeometry,
        planes: Vec<PlaneLayout>,
        memory: Vec<HostMemory>,
        spec: Option<Py<PyPoolSpec>>,
    ) -> PyResult<Self> {
        let mut addrs = Vec::with_capacity(planes.len());
        let mut owners = Vec::with_capacity(planes.len());
        let mut storages = Vec::new();
        for (p, (pl, mem)) in planes.iter().zip(memory).enumerate() {
            if mem.len < pl.nbytes || (mem.addr == 0 && pl.nbytes > 0) {
                return Err(value_err(format!(
                    "plane {p} memory of {} bytes at {:#x} cannot hold {} bytes",
                    mem.len, mem.addr, pl.nbytes
                )));
            }
            addrs.push(mem.addr);
            owners.push(mem.owner);
            storages.extend(mem.watch.map(|w| (p, w)));
        }
        Ok(Self {
            geom: geom_of(addrs),
            planes,
            spec,
            _owners: owners,
            storages,
            watch: None,
        })
    }

    /// Refuses any use of the planes' bytes once a torch storage they lie in was resized,
    /// freed or moved (see `memory`).
    pub(crate) fn check_memory(&self, py: Python<'_>) -> PyResult<()> {
        for (p, storage) in &self.storages {
            storage.check(py, || format!("host pool plane {p}"))?;
        }
        Ok(())
    }

    /// Every plane storage's allocation words as they are now, without running Python (see
    /// `StorageWatch::words_now`).
    pub(crate) fn memory_words(&self, py: Python<'_>) -> Vec<Option<extent::AllocationWords>> {
        self.storages
            .iter()
            .map(|(_, storage)| storage.words_now(py))
            .collect()
    }

    /// Whether this pool's pages are watched (`HOSTKV_PAGE_DIGEST`).
    pub(crate) fn watches(&self) -> bool {
        self.watch.is_some()
    }

    /// Digests the pages `rows` touch, just written by a backup (watched pools only). `rows`
    /// are the physical rows the transfer moved: under DCP, this rank's share of the logical
    /// slots it was given, whose page `p` is logical page `p`.
    pub(crate) fn record_pages(&self, py: Python<'_>, rows: &[i64]) -> PyResult<()> {
        let Some(watch) = &self.watch else {
            return Ok(());
        };
        let spec = &self.spec_of("page_digests")?.spec;
        let pages = digest::pages_touched(rows, spec.page_size);
        let page = spec.logical_page_size();
        let digests = self.page_digests(py, digest::page_slots(&pages, page))?;
        watch.record(&pages, &digests);
        Ok(())
    }

    /// Refuses a load of `indices` (whose physical rows `rows` reads, as in `record_pages`)
    /// when a page it touches changed since its backup (watched pools only); `name` names the
    /// pool in the refusal.
    pub(crate) fn verify_pages(
        &self,
        py: Python<'_>,
        name: &str,
        indices: &Bound<'_, PyAny>,
        rows: impl FnOnce() -> PyResult<Vec<i64>>,
    ) -> PyResult<()> {
        let Some(watch) = &self.watch else {
            return Ok(());
        };
        if watch.already_verified(indices) {
            return Ok(());
        }
        let spec = &self.spec_of("page_digests")?.spec;
        let page = spec.logical_page_size();
        let known = watch
            .digests
            .known(&digest::pages_touched(&rows()?, spec.page_size));
        if !known.is_empty() {
            let pages: Vec<u64> = known.iter().map(|&(p, _)| p).collect();
            let now = self.page_digests(py, digest::page_slots(&pages, page))?;
            if let Some((p, _)) = known.iter().zip(now).find(|((_, want), got)| want != got) {
                return Err(page_watch::changed_page(name, p.0, page));
            }
        }
        watch.replace_verified(Some(indices));
        Ok(())
    }

    /// Forgets the pages `slots` touch: they may be written by other means until their next
    /// backup.
    fn forget(&self, slots: &[i64]) -> PyResult<()> {
        if let Some(watch) = &self.watch {
            let page = self.spec_of("forget_pages")?.spec.logical_page_size();
            watch.forget(&digest::pages_touched(slots, page));
        }
        Ok(())
    }

    /// The pool's planes `planes` alone, in that order (a binding that moves only some of
    /// them: V4's page rows without the scale rows attached beside them). None: every plane.
    pub(crate) fn plane_view(&self, planes: Option<&[usize]>) -> crate::Result<HostGeometry> {
        let Some(planes) = planes else {
            return Ok(self.geom.clone());
        };
        let n = self.geom.item_bytes.len();
        let mut seen = vec![false; n];
        for &p in planes {
            if p >= n || std::mem::replace(&mut seen[p], true) {
                return Err(crate::Error::value(format!(
                    "planes must be distinct planes of this pool's {n}, got {planes:?}"
                )));
            }
        }
        if planes.is_empty() {
            return Err(crate::Error::value("planes must name at least one plane"));
        }
        Ok(HostGeometry {
            item_bytes: planes.iter().map(|&p| self.geom.item_bytes[p]).collect(),
            plane_base: planes.iter().map(|&p| self.geom.plane_base[p]).collect(),
            ..self.geom.clone()
        })
    }

    /// The rows a binding with `map` addresses in `g` (the pool's rows, or some of its planes),
    /// when they are not `g`'s own: a DeepSeek V4 layer_first plane of C4 page rows read through
    /// the C4 value or scale map is the same bytes as rows of one value (576 B) or one scale
    /// (8 B). None: `g`'s rows.
    pub(crate) fn row_view(g: &HostGeometry, map: IndexMap) -> crate::Result<Option<HostGeometry>> {
        use crate::pool::c4;
        let per_row = match map {
            IndexMap::C4Value => (c4::VALUES_PER_ROW, c4::VALUE_BYTES),
            IndexMap::C4Scale => (c4::SCALES_PER_ROW, c4::SCALE_BYTES),
            _ => return Ok(None),
        };
        if g.item_bytes.len() == 1 && g.item_bytes[0] as u64 == per_row.1 {
            return Ok(None); // already rows of that unit
        }
        let c4_rows = g.layout == Layout::LayerFirst
            && g.page_size == 1
            && g.item_bytes == [c4::ROW_BYTES as usize];
        if !c4_rows {
            return Err(crate::Error::value(format!(
                "the C4 token maps read a layer_first pool of {}-byte C4 page rows; this pool \
                 has {} layout rows of {:?} bytes",
                c4::ROW_BYTES,
                g.layout.name(),
                g.item_bytes
            )));
        }
        // Same bytes: every layer's rows * ROW_BYTES = (rows * per_row) * unit.
        Ok(Some(HostGeometry {
            rows: g.rows * per_row.0 as usize,
            item_bytes: vec![per_row.1 as usize],
            ..g.clone()
        }))
    }

    /// The spec a page question is answered by.
    fn spec_of(&self, what: &str) -> PyResult<&PyPoolSpec> {
        match &self.spec {
            Some(spec) => Ok(spec.get()),
            _ => Err(value_err(format!(
                "{what}: this host pool was built without a PoolSpec (HostPool.from_geometry)"
            ))),
        }
    }

    /// Runs one transfer on `engine` (queued on `stream` for a CUDA engine); every argument is
    /// checked (by the planner or the kernel path's validation) before a byte moves, except the
    /// plane memory, which the caller checks (`check_memory`).
    ///
    /// # Safety
    /// `device_ptrs` are the bases of live device layers (plane-major) of `rows` rows of each
    /// plane's item size (`row_pitch` bytes apart when set), in the memory `engine` names; the
    /// index arrays are contiguous arrays of the stated width, length and residency. The caller
    /// keeps all of them alive and unwritten for the call (CUDA: until the work queued on
    /// `stream` has run, which the caching allocator's stream order guarantees for tensors freed
    /// after the call). And the caller checked the plane memory (`check_memory`) in this call,
    /// with nothing since that could have changed it (no Python run: see `memory_words`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_checked(
        &self,
        py: Python<'_>,
        backend: Backend,
        op: Op,
        device_ptrs: Vec<u64>,
        rows: usize,
        row_pitch: Option<u64>,
        host_idx: IndexArray,
        dev_idx: IndexArray,
        engine: &dyn CopyEngine,
        stream: u64,
        view: Option<&HostGeometry>,
    ) -> PyResult<()> {
        let device_side = DeviceSide {
            layer_ptrs: device_ptrs,
            rows,
            row_pitch,
            memory: engine.memory(),
        };
        // SAFETY: the plane addresses are this core's own memory, held alive by `_owners`; the
        // device side and the index arrays are what this function's caller guarantees.
        let req = unsafe {
            TransferRequest::new(
                view.unwrap_or(&self.geom).clone(),
                backend,
                op,
                device_side,
                host_idx,
                dev_idx,
            )
        };
        engine.run(&req, stream, &Gil(py)).map_err(|e| to_py(py, e))
    }
}

#[pymethods]
impl PyHostPool {
    /// The pool `spec` describes over `allocations`, the tensors (or `HostRegion`s) its
    /// `allocations()` lists, in that order.
    /// `watch_pages`: digest the pages backups write and verify them before loads
    /// (`HOSTKV_PAGE_DIGEST`; not for page_unified pools, which have no page metadata).
    #[new]
    #[pyo3(signature = (spec, allocations, *, watch_pages = false))]
    fn new(
        py: Python<'_>,
        spec: Py<PyPoolSpec>,
        allocations: Vec<Bound<'_, PyAny>>,
        watch_pages: bool,
    ) -> PyResult<Self> {
        let s = &spec.get().spec;
        let (shapes, placement) = s.allocations();
        if allocations.len() != shapes.len() {
            return Err(value_err(format!(
                "this pool has {} allocation(s), got {}",
                shapes.len(),
                allocations.len()
            )));
        }
        let mut memory = Vec::with_capacity(placement.len());
        for (p, &(alloc, offset)) in placement.iter().enumerate() {
            let pair = (allocations[alloc].clone(), offset).into_pyobject(py)?;
            memory.push(host_memory(pair.as_any(), &format!("plane {p}"))?);
        }
        let planes = s.planes().to_vec();
        let first = &planes[0];
        let (layout, layers, rows, page) = (
            first.layout,
            first.layers as usize,
            first.rows as usize,
            first.page_size as usize,
        );
        let heads = first.heads as usize;
        let items: Vec<usize> = planes.iter().map(|p| p.item as usize).collect();
        let geom_of = move |plane_base| HostGeometry {
            layout,
            layers,
            rows,
            page_size: page,
            heads,
            item_bytes: items,
            plane_base,
        };
        let mut pool = Self::with_memory(geom_of, planes, memory, Some(spec.clone_ref(py)))?;
        if watch_pages {
            if s.unified().is_some() {
                return Err(value_err(
                    "page_unified pools have no page metadata to digest pages by",
                ));
            }
            pool.watch = Some(PageWatch::default());
        }
        Ok(pool)
    }

    /// Whether this pool's pages are watched (`HOSTKV_PAGE_DIGEST`).
    #[getter]
    fn watches_pages(&self) -> bool {
        self.watches()
    }

    /// Forgets the digests of the pages `slots` touch (a new owner may write them by means the
    /// core does not see).
    fn forget_pages(&self, slots: Vec<i64>) -> PyResult<()> {
        self.forget(&slots)
    }

    /// Forgets the digests of the pages a flat page written at `index` covered.
    fn forget_flat_page(&self, py: Python<'_>, index: i64) -> PyResult<()> {
        if let Some(watch) = &self.watch {
            let spec = &self.spec_of("forget_flat_page")?.spec;
            watch.forget(&spec.flat_page_pages(index).map_err(|e| to_py(py, e))?);
        }
        Ok(())
    }

    /// A pool of explicit row geometry, without a spec (tests and benchmarks of the core's
    /// raw calls): each plane a `HostRegion`, a CPU tensor or `(owner, byte_offset)`.
    #[staticmethod]
    #[pyo3(signature = (layout, num_layers, rows, page_size, item_bytes, planes, head_num = 1))]
    #[allow(clippy::too_many_arguments)]
    fn from_geometry(
        py: Python<'_>,
        layout: &str,
        num_layers: usize,
        rows: usize,
        page_size: usize,
        item_bytes: Vec<usize>,
        planes: Vec<Bound<'_, PyAny>>,
        head_num: usize,
    ) -> PyResult<Self> {
        let layout = Layout::parse(layout).map_err(|e| to_py(py, e))?;
        if item_bytes.is_empty() || item_bytes.len() > 2 || item_bytes.len() != planes.len() {
            return Err(value_err(format!(
                "a host pool has 1 or 2 planes: got {} item sizes and {} planes",
                item_bytes.len(),
                planes.len()
            )));
        }
        if item_bytes.contains(&0) {
            return Err(value_err(format!(
                "item_bytes must be positive (bytes of one row of one layer), got {item_bytes:?}"
            )));
        }
        // page_unified's planes (MHA's K and V) are components of one allocation: the same
        // memory is passed for each.
        let n = item_bytes.len();
        let mut layouts = Vec::with_capacity(n);
        let mut memory = Vec::with_capacity(n);
        for (p, (&item, plane)) in item_bytes.iter().zip(&planes).enumerate() {
            let pl = PlaneLayout::plane(layout, num_layers, rows, page_size, item, head_num, p, n)
                .map_err(|e| to_py(py, e))?;
            layouts.push(pl);
            memory.push(host_memory(plane, &format!("plane {p}"))?);
        }
        let heads = if matches!(layout, Layout::PageHead | Layout::PageUnified) {
            head_num
        } else {
            1
        };
        let geom_of = move |plane_base| HostGeometry {
            layout,
            layers: num_layers,
            rows,
            page_size,
            heads,
            item_bytes,
            plane_base,
        };
        Self::with_memory(geom_of, layouts, memory, None)
    }

    /// The spec this pool follows (None for a row geometry built without one).
    #[getter]
    fn spec(&self, py: Python<'_>) -> Option<Py<PyPoolSpec>> {
        self.spec.as_ref().map(|s| s.clone_ref(py))
    }

    /// XXH3-128 of each page's bytes, taken over the pieces `page_meta` lists for it, hashed
    /// without the GIL: the debug check that a host page did not change between its backup and a
    /// load (`HOSTKV_PAGE_DIGEST`). `indices` as `page_meta` takes them. The caller keeps those
    /// pages unchanged during the call (a page written meanwhile hashes as a change).
    pub(crate) fn page_digests(&self, py: Python<'_>, indices: Vec<i64>) -> PyResult<Vec<u128>> {
        let spec = &self.spec_of("page_digests")?.spec;
        self.check_memory(py)?;
        let starts = spec.page_starts(&indices).map_err(|e| to_py(py, e))?;
        let (ptrs, sizes) = spec
            .page_meta(&self.geom.plane_base, &starts)
            .map_err(|e| to_py(py, e))?;
        let per_page = ptrs.len().checked_div(starts.len()).unwrap_or(0).max(1);
        let pieces: Vec<(u64, u64)> = ptrs.into_iter().zip(sizes).collect();
        Ok(py.detach(|| {
            pieces
                .chunks(per_page)
                .map(|page| {
                    crate::digest::digest128(page.iter().map(|&(ptr, len)| {
                        // SAFETY: `page_meta` places every piece inside this pool's planes
                        // (validated page starts, the spec's arithmetic); `self` holds the
                        // memory's owners for the call, and the caller keeps the bytes
                        // unchanged (documented above).
                        unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) }
                    }))
                })
                .collect()
        }))
    }

    /// `get_page_buffer_meta`: (pointers, sizes) into this pool's planes for the pages
    /// `indices` lists (every page's first slot; logical slots under DCP).
    fn page_meta(&self, py: Python<'_>, indices: Vec<i64>) -> PyResult<(Vec<u64>, Vec<u64>)> {
        let spec = &self.spec_of("page_meta")?.spec;
        self.check_memory(py)?;
        let starts = spec.page_starts(&indices).map_err(|e| to_py(py, e))?;
        let meta = spec
            .page_meta(&self.geom.plane_base, &starts)
            .map_err(|e| to_py(py, e))?;
        self.forget(&indices)?; // handed out by address: writable by other means
        Ok(meta)
    }

    /// `get_split_heads_page_buffer_meta` (MHA page_head): the layout is checked before the
    /// split, as SGLang asserts it first.
    fn split_heads_meta(
        &self,
        py: Python<'_>,
        indices: Vec<i64>,
        split_factor: &Bound<'_, pyo3::types::PyInt>,
    ) -> PyResult<(Vec<u64>, Vec<u64>)> {
        let spec = &self.spec_of("split_heads_meta")?.spec;
        spec.check_split_heads_layout().map_err(|e| to_py(py, e))?;
        if split_factor.le(0)? {
            return Err(value_err(format!(
                "split_factor must be positive, got {split_factor}"
            )));
        }
        // Past u64 it cannot divide the head count: SGLang's assert, with the value given.
        let Ok(split_factor) = split_factor.extract::<u64>() else {
            return Err(to_py(
                py,
                crate::error::Error::assertion(format!(
                    "head_num ({}) must be a multiple of split_factor ({split_factor})",
                    self.geom.heads
                )),
            ));
        };
        self.check_memory(py)?;
        let meta = spec
            .split_heads_meta(&self.geom.plane_base, &indices, split_factor)
            .map_err(|e| to_py(py, e))?;
        self.forget(&indices)?; // handed out by address: writable by other means
        Ok(meta)
    }

    /// `get_contiguous_buf_infos` (MLA, V4) of this pool's bytes.
    fn contiguous_buf_infos(&self, py: Python<'_>) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
        let spec = &self.spec_of("contiguous_buf_infos")?.spec;
        self.check_memory(py)?;
        spec.contiguous_buf_infos(self.geom.plane_base[0])
            .map_err(|e| to_py(py, e))
    }

    /// SGLang's `is_stride_page_aligned`: every plane's start and page stride are multiples of
    /// `page_size_bytes` (False for the layouts without a page stride).
    fn is_stride_page_aligned(&self, page_size_bytes: &Bound<'_, PyAny>) -> PyResult<bool> {
        let spec = &self.spec_of("is_stride_page_aligned")?.spec;
        let page_size_bytes = page_size_bytes.cast::<pyo3::types::PyInt>()?;
        if page_size_bytes.lt(0)? {
            return Err(value_err(format!(
                "page_size_bytes must be positive, got {page_size_bytes}"
            )));
        }
        let Ok(page_size_bytes) = page_size_bytes.extract::<u64>() else {
            // Past 2**64: no plane address or page stride (all nonzero, below 2**64) is a
            // multiple of it.
            return Ok(false);
        };
        if page_size_bytes == 0 {
            return Err(value_err("page_size_bytes must be positive, got 0"));
        }
        Ok(spec.page_strides().is_some_and(|strides| {
            strides
                .iter()
                .zip(&self.geom.plane_base)
                .all(|(stride, base)| base % page_size_bytes == 0 && stride % page_size_bytes == 0)
        }))
    }

    /// Bytes of one plane (`L * S * I`), with the same checks as the constructor.
    #[staticmethod]
    #[pyo3(signature = (layout, num_layers, rows, page_size, item_bytes, head_num = 1))]
    fn plane_nbytes(
        py: Python<'_>,
        layout: &str,
        num_layers: usize,
        rows: usize,
        page_size: usize,
        item_bytes: usize,
        head_num: usize,
    ) -> PyResult<u64> {
        let layout = Layout::parse(layout).map_err(|e| to_py(py, e))?;
        crate::layout::plane_nbytes(layout, num_layers, rows, page_size, item_bytes, head_num)
            .map_err(|e| to_py(py, e))
    }

    /// Byte offset of (row, layer, head) inside plane `plane`.
    #[pyo3(signature = (plane, row, layer, head = 0))]
    fn offset(&self, py: Python<'_>, plane: i64, row: i64, layer: i64, head: i64) -> PyResult<u64> {
        let pl = usize::try_from(plane)
            .ok()
            .and_then(|p| self.planes.get(p))
            .ok_or_else(|| {
                transfer_err(
                    py,
                    format!("plane {plane} is out of range [0, {})", self.planes.len()),
                )
            })?;
        for (name, v) in [("row", row), ("layer", layer), ("head", head)] {
            if v < 0 {
                return Err(transfer_err(py, format!("{name} {v} is negative")));
            }
        }
        pl.offset(row as u64, layer as u64, head as u64)
            .map_err(|e| to_py(py, e))
    }

    #[getter]
    fn layout(&self) -> &'static str {
        self.geom.layout.name()
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.geom.layers
    }

    #[getter]
    fn rows(&self) -> usize {
        self.geom.rows
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.geom.page_size
    }

    #[getter]
    fn head_num(&self) -> usize {
        self.geom.heads
    }

    #[getter]
    fn item_bytes(&self) -> Vec<usize> {
        self.geom.item_bytes.clone()
    }

    /// Refused once a plane's storage no longer holds the memory (as every transfer is).
    #[getter]
    fn plane_addrs(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.check_memory(py)?;
        Ok(self.geom.plane_base.clone())
    }

    /// Raw entry point (tests and benchmarks; cargo feature `raw-calls`, which the release wheel
    /// leaves out, because it takes addresses it cannot check). Device layers -> host: every
    /// layer (`device_ptrs` holds `nplanes * L` layer bases), or only `host_layer` (`device_ptrs`
    /// holds `nplanes` bases) for a layer-sharded pool.
    #[cfg(feature = "raw-calls")]
    #[pyo3(signature = (backend, device_ptrs, device_rows, host_idx, dev_idx, device, stream, engine = "plan", host_layer = None, *, index_map = None))]
    #[allow(clippy::too_many_arguments)]
    fn backup(
        &self,
        py: Python<'_>,
        backend: &str,
        device_ptrs: Vec<u64>,
        device_rows: i64,
        host_idx: IndexArg,
        dev_idx: IndexArg,
        device: &str,
        stream: u64,
        engine: &str,
        host_layer: Option<i64>,
        index_map: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let map = args::index_map(index_map)?;
        let op = match host_layer {
            None => Op::Backup,
            Some(layer) => Op::BackupLayer {
                host_layer: self.host_layer_arg(py, layer)?,
            },
        };
        self.transfer(
            py,
            backend,
            op,
            device_ptrs,
            device_rows,
            host_idx,
            dev_idx,
            device,
            stream,
            engine,
            map,
        )
    }

    /// Raw entry point (feature `raw-calls`, as `backup`). Host layer `host_layer` -> one device
    /// layer: `device_ptrs` holds `nplanes` layer bases.
    #[cfg(feature = "raw-calls")]
    #[pyo3(signature = (backend, host_layer, device_ptrs, device_rows, host_idx, dev_idx, device, stream, engine = "plan", *, index_map = None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        &self,
        py: Python<'_>,
        backend: &str,
        host_layer: i64,
        device_ptrs: Vec<u64>,
        device_rows: i64,
        host_idx: IndexArg,
        dev_idx: IndexArg,
        device: &str,
        stream: u64,
        engine: &str,
        index_map: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let map = args::index_map(index_map)?;
        let host_layer = self.host_layer_arg(py, host_layer)?;
        self.transfer(
            py,
            backend,
            Op::Load { host_layer },
            device_ptrs,
            device_rows,
            host_idx,
            dev_idx,
            device,
            stream,
            engine,
            map,
        )
    }
}
