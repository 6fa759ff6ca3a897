//! A host pool in SGLang's terms — kind, layout, geometry — and everything Python needs derived
//! from it: the buffers' shapes, the (layout, io_backend) pairs each kind serves with SGLang's
//! refusal texts, L3 page metadata and page views (DCP included), and the DeepSeek V4 C4 page row's
//! constants (transfers translate indices through `crate::index_map`). The planner and the kernels address bytes through the same
//! [`PlaneLayout`]s this spec builds.

use crate::error::{Error, Result};
use crate::layout::PlaneLayout;
use crate::request::{Backend, Layout};
use crate::support::{self, Transfer};

/// Which SGLang host pool this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    /// `MHATokenToKVPoolHost`: K and V planes of `H x D` elements, one allocation.
    Mha,
    /// `AsymmetricMHATokenToKVPoolHost`: K `H x D`, V `H x Dv`, two allocations.
    AsymmetricMha,
    /// `MLATokenToKVPoolHost`: one latent plane of `C` elements.
    Mla,
    /// `DeepSeekV4PagedHostPool`: one plane of `item_bytes`-byte page rows, and a second of the
    /// NPU indexer's scale rows (same rows and layout, their own row bytes and allocation) once
    /// they are attached.
    V4Paged,
}

impl PoolKind {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "mha" => Ok(Self::Mha),
            "mha_asymmetric" => Ok(Self::AsymmetricMha),
            "mla" => Ok(Self::Mla),
            "v4_paged" => Ok(Self::V4Paged),
            other => Err(Error::geometry(format!(
                "unknown pool kind {other:?}; expected mha, mha_asymmetric, mla or v4_paged"
            ))),
        }
    }
}

/// Largest layer count a pool may have (models have at most a few hundred).
pub const MAX_LAYERS: usize = 1 << 16;

/// What an L3 page index names, checked: its first physical host slot (row for V4).
pub type PageStart = u64;

/// A strided view of one page, in elements of the pool's dtype, relative to the first element of
/// the pool's (first) allocation: what `torch.as_strided` takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageView {
    pub offset: u64,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
}

/// A host pool's geometry, validated once.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    pub kind: PoolKind,
    pub layout: Layout,
    /// `L`: host layers (MTP draft layers included).
    pub layers: u64,
    /// `S`: token slots (V4: page rows).
    pub rows: u64,
    /// `P`: tokens per page (V4: `slot_page_size`, the tokens one page row holds).
    pub page_size: u64,
    /// `H` (1 for MLA and V4).
    pub heads: u64,
    /// `G`: page_unified's head groups (SGLang's `head_group_num`; 1 for every other layout).
    pub head_groups: u64,
    /// Per plane: elements per head (`D`, `Dv`), `C`, or the V4 row's bytes.
    pub dims: Vec<u64>,
    /// Bytes per element (1 for V4).
    pub itemsize: u64,
    /// DCP (MLA): slots are logical, `dcp_size` of them share a physical row.
    pub dcp_size: u64,
    pub dcp_rank: u64,
    /// Names the pool in V4's error texts.
    pub name: String,
    /// The SGLang release the pool follows (None: the newest), for the answers that changed
    /// between releases.
    pub release: Option<crate::support::Release>,
    planes: Vec<PlaneLayout>,
}

/// page_unified's head groups: MLA has no head axis, so one.
fn head_groups_of(kind: PoolKind, head_groups: usize) -> usize {
    if kind == PoolKind::Mla {
        1
    } else {
        head_groups
    }
}

fn overflow(what: &str) -> Error {
    Error::geometry(format!(
        "host pool geometry overflows 64-bit sizes ({what})"
    ))
}

impl PoolSpec {
    /// `dims` holds one entry per plane: MHA `[D, D]`, asymmetric `[D, Dv]`, MLA `[C]`, V4
    /// `[item_bytes]`. For V4, `rows` counts page rows and the planes are addressed by row
    /// (page size 1); `page_size` is the slot page that maps tokens to rows.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: PoolKind,
        layout: &str,
        layers: usize,
        rows: usize,
        page_size: usize,
        heads: usize,
        dims: &[usize],
        itemsize: usize,
        dcp_size: usize,
        dcp_rank: usize,
        name: &str,
    ) -> Result<Self> {
        Self::grouped(
            kind, layout, layers, rows, page_size, heads, 1, dims, itemsize, dcp_size, dcp_rank,
            name,
        )
    }

    /// [`new`](Self::new) with page_unified's `head_group_num` (ignored by other layouts, as
    /// SGLang ignores it).
    #[allow(clippy::too_many_arguments)]
    pub fn grouped(
        kind: PoolKind,
        layout: &str,
        layers: usize,
        rows: usize,
        page_size: usize,
        heads: usize,
        head_groups: usize,
        dims: &[usize],
        itemsize: usize,
        dcp_size: usize,
        dcp_rank: usize,
        name: &str,
    ) -> Result<Self> {
        let layout = support::build(kind, layout)?;
        let want = match kind {
            PoolKind::Mha | PoolKind::AsymmetricMha => 2,
            // The page rows, and the NPU indexer's scale rows once they are attached.
            PoolKind::V4Paged if dims.len() == 2 => 2,
            PoolKind::Mla | PoolKind::V4Paged => 1,
        };
        if dims.len() != want {
            return Err(Error::geometry(format!(
                "a {kind:?} pool has {want} plane(s), got {} dims",
                dims.len()
            )));
        }
        if layout == Layout::PageUnified {
            let mla = kind == PoolKind::Mla;
            let (h, g) = if mla { (1, 1) } else { (heads, head_groups) };
            let field = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
            unified::check([page_size, layers, h, g, dims[0], itemsize].map(field), mla)?;
        }
        for (what, v) in [
            ("page_size", page_size),
            ("itemsize", itemsize),
            ("dcp_size", dcp_size),
        ] {
            if v == 0 {
                return Err(Error::geometry(format!("{what} must be positive, got 0")));
            }
        }
        // Slot numbers are Python ints read as i64: the pool's (logical) slots must fit one.
        let tokens = if kind == PoolKind::V4Paged {
            rows.checked_mul(page_size)
        } else {
            rows.checked_mul(dcp_size)
        };
        let page_tokens = page_size.checked_mul(dcp_size);
        if [tokens, page_tokens]
            .iter()
            .any(|t| t.is_none_or(|t| t > i64::MAX as usize))
        {
            return Err(overflow(
                "the pool's token slots do not fit in a signed 64-bit index",
            ));
        }
        // Per-layer answers (page metadata, buffer infos) have one entry per layer: a layer
        // count no model has would only exhaust memory building them.
        if layers > MAX_LAYERS {
            return Err(Error::geometry(format!(
                "num_layers must lie in [0, {MAX_LAYERS}], got {layers}"
            )));
        }
        if dcp_rank >= dcp_size {
            return Err(Error::geometry(format!(
                "dcp_rank must lie in [0, {dcp_size}), got {dcp_rank}"
            )));
        }
        let heads = match kind {
            PoolKind::Mha | PoolKind::AsymmetricMha => heads,
            PoolKind::Mla | PoolKind::V4Paged => 1,
        };
        if heads == 0 || dims.contains(&0) {
            return Err(Error::geometry(format!(
                "head_num and every head dim must be positive, got head_num={heads}, dims={dims:?}"
            )));
        }
        if kind != PoolKind::V4Paged && rows % page_size != 0 {
            return Err(Error::geometry(format!(
                "the host pool holds whole pages: size={rows} is not a multiple of \
                 page_size={page_size}"
            )));
        }
        let (plane_rows, plane_page) = if kind == PoolKind::V4Paged {
            (rows, 1)
        } else {
            (rows, page_size)
        };
        let mut planes = Vec::with_capacity(dims.len());
        for &dim in dims {
            let item = (heads as u64)
                .checked_mul(dim as u64)
                .and_then(|x| x.checked_mul(itemsize as u64))
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| overflow("head_num * head_dim * itemsize"))?;
            // Strides span a whole layer and a whole page even in a pool of zero layers or
            // rows: they must fit too, not only the plane's byte size.
            let one_layer = layers.max(1) as u64;
            for (what, n) in [("rows", plane_rows), ("page_size", plane_page)] {
                one_layer
                    .checked_mul(n as u64)
                    .and_then(|x| x.checked_mul(item as u64))
                    .ok_or_else(|| overflow(&format!("num_layers * {what} * item_bytes")))?;
            }
            let plane_heads = match layout {
                Layout::PageHead => heads,
                // K and V interleave inside each layer cell of each head group's block.
                Layout::PageUnified => head_groups_of(kind, head_groups),
                _ => 1,
            };
            planes.push(PlaneLayout::plane(
                layout,
                layers,
                plane_rows,
                plane_page,
                item,
                plane_heads,
                planes.len(),
                want,
            )?);
        }
        Ok(Self {
            kind,
            layout,
            layers: layers as u64,
            rows: rows as u64,
            page_size: page_size as u64,
            heads: heads as u64,
            head_groups: if layout == Layout::PageUnified {
                head_groups_of(kind, head_groups) as u64
            } else {
                1
            },
            dims: dims.iter().map(|&d| d as u64).collect(),
            itemsize: itemsize as u64,
            dcp_size: dcp_size as u64,
            dcp_rank: dcp_rank as u64,
            name: name.to_owned(),
            release: None,
            planes,
        })
    }

    pub fn planes(&self) -> &[PlaneLayout] {
        &self.planes
    }

    /// Bytes of one row of one layer of `plane` (`token_stride_size`; the V4 row).
    pub fn item_bytes(&self, plane: usize) -> u64 {
        self.planes[plane].item
    }

    /// Elements of one row of one layer of `plane`.
    fn row_elems(&self, plane: usize) -> u64 {
        self.heads * self.dims[plane]
    }

    /// Pages of the pool (V4: page rows).
    pub fn page_num(&self) -> u64 {
        if self.kind == PoolKind::V4Paged {
            self.rows
        } else {
            self.rows / self.page_size
        }
    }

    /// The element shape of `plane` as SGLang's tensor has it (MHA's `k_buffer` / `v_buffer`;
    /// V4 layer_first: the per-layer buffers stacked along a leading layer dim).
    pub fn shape(&self, plane: usize) -> Vec<u64> {
        let (l, s, p, h, w) = (
            self.layers,
            self.rows,
            self.page_size,
            self.heads,
            self.dims[plane],
        );
        let pn = self.page_num();
        let g = self.head_groups;
        match (self.kind, self.layout) {
            // SGLang's page_dims: one fused tensor for both planes.
            (PoolKind::Mla, Layout::PageUnified) => vec![pn, l, p, w],
            (_, Layout::PageUnified) => vec![pn, g, l, 2, p, h / g, w],
            (PoolKind::V4Paged, Layout::LayerFirst) => vec![l, s, w],
            (PoolKind::V4Paged, Layout::PageFirst) => vec![s, l, w],
            (PoolKind::V4Paged, _) => vec![s, l, 1, w],
            (PoolKind::Mla, Layout::LayerFirst) => vec![l, s, 1, w],
            (PoolKind::Mla, Layout::PageFirst) => vec![s, l, 1, w],
            (PoolKind::Mla, _) => vec![pn, l, p, 1, w],
            (_, Layout::LayerFirst) => vec![l, s, h, w],
            (_, Layout::PageFirst) => vec![s, l, h, w],
            (_, Layout::PageFirstDirect) => vec![pn, l, p, h, w],
            (_, Layout::PageHead) => vec![pn, h, p, l, w],
        }
    }

    /// Elements of `plane`.
    /// Elements of `plane`'s allocation (page_unified: the one allocation its planes share).
    pub fn plane_elems(&self, plane: usize) -> u64 {
        self.planes[plane].nbytes / self.itemsize
    }

    /// SGLang's `PageUnifiedLayout` facts, for a page_unified pool.
    pub fn unified(&self) -> Option<unified::Unified> {
        (self.layout == Layout::PageUnified).then(|| unified::Unified {
            components: self.planes.len() as u64,
            page_size: self.page_size,
            layers: self.layers,
            head_groups: self.head_groups,
            group_bytes: self.planes[0].segment,
        })
    }

    /// The support table's route for a transfer of `transfer` kind on this pool, or SGLang's
    /// refusal text; `io_backend` is None when the caller passed something that is not a string
    /// (`shown` is its text).
    pub fn route(
        &self,
        io_backend: Option<&str>,
        shown: &str,
        transfer: Transfer,
    ) -> Result<support::Route> {
        support::route(
            self.kind,
            self.layout,
            io_backend,
            shown,
            transfer,
            &self.name,
            self.release,
        )
    }

    /// SGLang's (layout, io_backend) check for slot transfers: the engine backend they use.
    pub fn check_pair(&self, io_backend: Option<&str>, shown: &str) -> Result<Backend> {
        Ok(self.route(io_backend, shown, Transfer::Slots)?.backend)
    }

    // ---- memory ----------------------------------------------------------------------------

    /// The tensors the pool allocates (their element shapes) and, per plane, which allocation
    /// holds it at which byte offset. MHA keeps K and V in one allocation, V right after K;
    /// page_unified's planes are components of one block (both at offset 0); asymmetric MHA
    /// has one allocation per plane.
    pub fn allocations(&self) -> (Vec<Vec<u64>>, Vec<(usize, u64)>) {
        match (self.kind, self.layout) {
            (PoolKind::Mha, Layout::PageUnified) => (vec![self.shape(0)], vec![(0, 0), (0, 0)]),
            (PoolKind::Mha, _) => {
                let mut both = self.shape(0);
                both.insert(0, 2);
                (vec![both], vec![(0, 0), (0, self.planes[0].nbytes)])
            }
            (PoolKind::AsymmetricMha, _) => {
                (vec![self.shape(0), self.shape(1)], vec![(0, 0), (1, 0)])
            }
            (PoolKind::V4Paged, _) if self.planes.len() == 2 => {
                (vec![self.shape(0), self.shape(1)], vec![(0, 0), (1, 0)])
            }
            (PoolKind::Mla | PoolKind::V4Paged, _) => (vec![self.shape(0)], vec![(0, 0)]),
        }
    }

    /// Bytes of one page of `plane`, all layers (page_unified: the fused page block); 0 for a
    /// pool of no pages.
    fn page_bytes(&self, plane: usize) -> u64 {
        self.planes[plane]
            .nbytes
            .checked_div(self.page_num())
            .unwrap_or(0)
    }

    /// Bytes a chunked CUDA host registration of `allocation` must not split, because one copy
    /// moves them as a unit (0: any split is fine). The page-major layouts copy a page of every
    /// layer; V4 a page row (layer_first: a row of one layer); layer_first and page_head MHA /
    /// MLA copy rows of one layer.
    pub fn registration_unit(&self, allocation: usize) -> u64 {
        let plane = match self.kind {
            PoolKind::AsymmetricMha | PoolKind::V4Paged => allocation,
            _ => 0,
        };
        match (self.kind, self.layout) {
            (PoolKind::V4Paged, Layout::LayerFirst) => self.item_bytes(plane),
            (PoolKind::V4Paged, _) => self.layers * self.item_bytes(plane),
            (_, Layout::PageFirst | Layout::PageFirstDirect | Layout::PageUnified) => {
                self.page_bytes(plane)
            }
            _ => 0,
        }
    }

    /// Bytes from one page to the next, per plane, for the layouts whose
    /// `is_stride_page_aligned` SGLang answers from the page stride (None: it answers False).
    pub fn page_strides(&self) -> Option<Vec<u64>> {
        let strided = match self.kind {
            PoolKind::Mha => !matches!(self.layout, Layout::LayerFirst | Layout::PageUnified),
            _ => matches!(self.layout, Layout::PageFirst | Layout::PageFirstDirect),
        };
        // V4's scale rows (the NPU indexer's) are not what SGLang asks this of: its page rows.
        let planes = match self.kind {
            PoolKind::V4Paged => 1,
            _ => self.planes.len(),
        };
        strided.then(|| (0..planes).map(|p| self.page_bytes(p)).collect())
    }

    /// The dim of a plane's tensor whose entries are SGLang's per-layer views (`k_data_refs`,
    /// `data_refs`): 1 where it transposes a page-major tensor to `[layer, page, ...]`
    /// (page_first; MHA page_first_direct on releases that transpose it, `transpose_direct`),
    /// else 0 (for the other page-major layouts dim 0 is the page: SGLang builds those views
    /// anyway and never reads them); None where no per-layer view exists (MHA page_unified, and
    /// V4's page layouts: SGLang keeps per-layer V4 buffers only layer_first).
    pub fn layer_view_dim(&self, transpose_direct: bool) -> Option<usize> {
        match (self.kind, self.layout) {
            (PoolKind::Mha | PoolKind::AsymmetricMha, Layout::PageUnified) => None,
            // SGLang keeps a V4 pool's rows as per-layer tensors only layer_first; its page
            // layouts have no per-layer host buffers (`data_refs` is empty).
            (PoolKind::V4Paged, Layout::LayerFirst) => Some(0),
            (PoolKind::V4Paged, _) => None,
            (_, Layout::PageFirst) => Some(1),
            (PoolKind::Mha | PoolKind::AsymmetricMha, Layout::PageFirstDirect)
                if transpose_direct =>
            {
                Some(1)
            }
            _ => Some(0),
        }
    }

    /// Whether a V4 pool's rows are the C4 page row that DeepSeek V4's token-granular path
    /// addresses (layer_first, 64-token pages, 37440-byte rows): only then does it have the
    /// per-token value and scale rows.
    pub fn token_rows(&self) -> bool {
        self.kind == PoolKind::V4Paged
            && self.layout == Layout::LayerFirst
            && self.page_size == c4::PAGE_TOKENS
            && self.dims.first() == Some(&c4::ROW_BYTES)
    }

    /// The element shape of the device-side write-back staging buffer SGLang allocates for a
    /// V4 page_first pool (at most 64 page rows of every layer; uint8), None where it has none.
    /// hostkv_rs never stages (the core copies straight into host memory), but callers and
    /// memory budgets see the same buffer.
    pub fn staging_shape(&self) -> Option<Vec<u64>> {
        const STAGING_PAGE_CHUNK: u64 = 64; // SGLang's _WRITE_BACK_STAGING_PAGE_CHUNK
        (self.kind == PoolKind::V4Paged && self.layout == Layout::PageFirst)
            .then(|| vec![self.rows.min(STAGING_PAGE_CHUNK), self.layers, self.dims[0]])
    }

    /// The shape SGLang's `get_dummy_flat_data_page` zero-fills before flattening (MHA:
    /// `[2, L, P, H, D]`; MLA: `[L, P, 1, C]`; V4: `[L, row bytes]`), in the pool's dtype.
    /// None for the asymmetric pool, which refuses flat pages.
    pub fn dummy_page_shape(&self) -> Option<Vec<u64>> {
        let (layers, page) = (self.layers, self.page_size);
        match self.kind {
            PoolKind::Mha => Some(vec![2, layers, page, self.heads, self.dims[0]]),
            PoolKind::Mla => Some(vec![layers, page, 1, self.dims[0]]),
            PoolKind::V4Paged => Some(vec![layers, self.dims[0]]),
            PoolKind::AsymmetricMha => None,
        }
    }

    // ---- L3 pages --------------------------------------------------------------------------

    /// Layouts whose page pointers assume a page-aligned first slot.
    fn page_major(&self) -> bool {
        match self.kind {
            PoolKind::Mha | PoolKind::AsymmetricMha => matches!(
                self.layout,
                Layout::PageFirstDirect | Layout::PageHead | Layout::PageUnified
            ),
            PoolKind::Mla => matches!(self.layout, Layout::PageFirstDirect | Layout::PageUnified),
            PoolKind::V4Paged => true,
        }
    }

    /// Slots (logical, under DCP) that name one page.
    pub fn logical_page_size(&self) -> u64 {
        self.page_size * self.dcp_size
    }

    /// The physical first slot of the page a caller names by `index` (SGLang's `get_data_page`
    /// argument; V4: the page row). MLA with DCP: `index` is a logical page start and this
    /// rank's page is `index / dcp_size` (SGLang 0.5.23 `_storage_page_index`).
    pub fn data_page_start(&self, index: i64) -> Result<PageStart> {
        if self.kind == PoolKind::V4Paged {
            let row = index.div_euclid(self.page_size as i64);
            if index < 0 || row as u64 >= self.rows {
                return Err(Error::page_index(format!(
                    "{} page index {index} out of range [0, {})",
                    self.name,
                    self.rows * self.page_size
                )));
            }
            return Ok(row as u64);
        }
        let index = self.storage_page_index(index)?;
        // SGLang's pools refuse page_unified here: after a DCP page start is read (MLA), and
        // before the index is taken for a slot (the bindings refuse it earlier where no DCP
        // start is read first).
        self.refuse_unified()?;
        let (s, p) = (self.rows as i64, self.page_size as i64);
        if self.page_major() {
            if !(0..s).contains(&index) {
                return Err(Error::page_index(format!(
                    "page index {index} is outside the host pool [0, {s})"
                )));
            }
        } else if !(0..=s - p).contains(&index) {
            return Err(Error::page_index(format!(
                "page starting at slot {index} does not fit in the host pool of {s} slots"
            )));
        }
        Ok(index as u64)
    }

    /// The pages (slot / page size, as the host slots of a transfer name them) that a flat
    /// page written at `index` covers: a slot-major layout takes the `P` slots from `index`,
    /// so a start inside a page covers two; the page layouts and V4 address one whole page.
    pub fn flat_page_pages(&self, index: i64) -> Result<Vec<u64>> {
        let start = self.data_page_start(index)?;
        if self.kind == PoolKind::V4Paged {
            return Ok(vec![start]);
        }
        let p = self.page_size;
        let last = if self.page_major() {
            start
        } else {
            start + p - 1
        };
        Ok((start / p..=last / p).collect())
    }

    /// DCP: a logical page start -> this rank's physical slot (identity without DCP).
    fn storage_page_index(&self, index: i64) -> Result<i64> {
        if self.dcp_size == 1 {
            return Ok(index);
        }
        let lp = self.logical_page_size() as i64;
        if index < 0 || index % lp != 0 {
            return Err(Error::value(
                "DCP L3 page start must be a nonnegative logical page boundary.",
            ));
        }
        let logical = (self.rows * self.dcp_size) as i64;
        if index.checked_add(lp).is_none_or(|end| end > logical) {
            return Err(Error::page_index("DCP L3 page is outside the host pool."));
        }
        Ok(index / self.dcp_size as i64)
    }

    /// The first physical slot (V4: row) of every page `indices` lists: every `P`-th entry
    /// (every logical page's first entry under DCP), each checked to name a whole page.
    pub fn page_starts(&self, indices: &[i64]) -> Result<Vec<PageStart>> {
        let n = indices.len() as u64;
        if self.kind == PoolKind::V4Paged {
            if n % self.page_size != 0 {
                // A TransferError: a ValueError, and the RuntimeError SGLang's reshape raises.
                return Err(Error::transfer(format!(
                    "{} get_page_buffer_meta needs whole pages: got {n} indices for page size {}",
                    self.name, self.page_size
                )));
            }
            return indices
                .iter()
                .step_by(self.page_size as usize)
                .map(|&i| self.data_page_start(i))
                .collect();
        }
        if self.dcp_size != 1 {
            let lp = self.logical_page_size();
            if n % lp != 0 {
                return Err(Error::assertion(format!(
                    "{n} indices is not a multiple of the logical page size {lp}"
                )));
            }
            let starts = indices
                .iter()
                .step_by(lp as usize)
                .map(|&i| self.storage_page_index(i).map(|t| t as u64))
                .collect::<Result<Vec<_>>>()?;
            // SGLang reads every logical page start before it refuses page_unified.
            self.refuse_unified()?;
            return Ok(starts);
        }
        let p = self.page_size;
        if n % p != 0 {
            return Err(Error::assertion(format!(
                "{n} indices is not a multiple of the page size {p}"
            )));
        }
        self.refuse_unified()?;
        let s = self.rows as i64;
        let mut out = Vec::with_capacity((n / p) as usize);
        for &t in indices.iter().step_by(p as usize) {
            if !(0..=s - p as i64).contains(&t) {
                return Err(Error::value(format!(
                    "page starting at slot {t} does not fit in the host pool of {s} slots"
                )));
            }
            if self.page_major() && t as u64 % p != 0 {
                return Err(Error::value(format!(
                    "slot {t} is not the first slot of a page (page size {p})"
                )));
            }
            out.push(t as u64);
        }
        Ok(out)
    }

    /// SGLang's `get_page_buffer_meta`: per page, (pointer, bytes) entries in SGLang's order.
    /// `bases` holds each plane's host address.
    pub fn page_meta(&self, bases: &[u64], starts: &[PageStart]) -> Result<(Vec<u64>, Vec<u64>)> {
        self.refuse_unified()?;
        let (l, s, p) = (self.layers, self.rows, self.page_size);
        let mut ptrs = Vec::new();
        let mut sizes = Vec::new();
        let item = |plane: usize| self.item_bytes(plane);
        match (self.kind, self.layout) {
            (PoolKind::V4Paged, Layout::LayerFirst) => {
                for &row in starts {
                    for layer in 0..l {
                        ptrs.push(bases[0] + layer * s * item(0) + row * item(0));
                        sizes.push(item(0));
                    }
                }
            }
            (PoolKind::V4Paged, _) => {
                for &row in starts {
                    ptrs.push(bases[0] + row * l * item(0));
                    sizes.push(l * item(0));
                }
            }
            (PoolKind::Mla, Layout::LayerFirst) => {
                for &t in starts {
                    for layer in 0..l {
                        ptrs.push(bases[0] + t * item(0) + layer * s * item(0));
                        sizes.push(p * item(0));
                    }
                }
            }
            (PoolKind::Mla, _) => {
                for &t in starts {
                    ptrs.push(bases[0] + t * l * item(0));
                    sizes.push(l * p * item(0));
                }
            }
            (_, Layout::LayerFirst) => {
                for &t in starts {
                    for layer in 0..l {
                        for (plane, &base) in bases.iter().enumerate().take(2) {
                            ptrs.push(base + t * item(plane) + layer * s * item(plane));
                            sizes.push(p * item(plane));
                        }
                    }
                }
            }
            _ => {
                // Page-major: `t` starts a page, so `t * L * I` is `page * P * L * I`.
                for &t in starts {
                    for (plane, &base) in bases.iter().enumerate().take(2) {
                        ptrs.push(base + t * l * item(plane));
                        sizes.push(l * p * item(plane));
                    }
                }
            }
        }
        Ok((ptrs, sizes))
    }

    /// SGLang 0.5.23 builds page_unified pools but has no page-metadata or flat-page arm for
    /// them: those calls refuse the layout, as there, before they read the page.
    pub fn refuse_unified(&self) -> Result<()> {
        if self.layout == Layout::PageUnified {
            return Err(Error::value("Unsupported layout: page_unified"));
        }
        Ok(())
    }

    /// SGLang's asserts of `get_split_heads_page_buffer_meta`, in its order: the layout, then the
    /// split, both before any index is read.
    /// SGLang's first assert of `get_split_heads_page_buffer_meta`, before the split is read.
    pub fn check_split_heads_layout(&self) -> Result<()> {
        if self.kind != PoolKind::Mha || self.layout != Layout::PageHead {
            return Err(Error::assertion(format!(
                "get_split_heads_page_buffer_meta requires layout='page_head', got {}",
                self.layout.name()
            )));
        }
        Ok(())
    }

    fn check_split_heads(&self, split_factor: u64) -> Result<()> {
        self.check_split_heads_layout()?;
        if split_factor == 0 || self.heads % split_factor != 0 {
            return Err(Error::assertion(format!(
                "head_num ({}) must be a multiple of split_factor ({split_factor})",
                self.heads
            )));
        }
        Ok(())
    }

    /// SGLang's `get_split_heads_page_buffer_meta` (MHA page_head): per page `indices` list and
    /// per group of `H / split_factor` heads, a [k, v] pair. The layout and the split are
    /// checked before the indices, as SGLang asserts them.
    pub fn split_heads_meta(
        &self,
        bases: &[u64],
        indices: &[i64],
        split_factor: u64,
    ) -> Result<(Vec<u64>, Vec<u64>)> {
        self.check_split_heads(split_factor)?;
        let starts = self.page_starts(indices)?;
        let (l, p, h, d, e) = (
            self.layers,
            self.page_size,
            self.heads,
            self.dims[0],
            self.itemsize,
        );
        let group = h / split_factor;
        let size = l * p * h * d * e / split_factor;
        let mut ptrs = Vec::new();
        for t in starts {
            for head in (0..h).step_by(group as usize) {
                let k = bases[0] + t * l * h * d * e + head * p * l * d * e;
                ptrs.push(k);
                ptrs.push(bases[1] + (k - bases[0]));
            }
        }
        let sizes = vec![size; ptrs.len()];
        Ok((ptrs, sizes))
    }

    /// The view of one L3 page (`get_data_page(index, flat=False)`), from a checked start. MHA
    /// (both planes in one allocation, V right after K) gets a leading plane dim of 2; V4
    /// layer_first spans the layers (SGLang stacks a copy there).
    pub fn page_view(&self, start: PageStart) -> Result<PageView> {
        self.refuse_unified()?;
        let (l, s, p) = (self.layers, self.rows, self.page_size);
        let plane_elems = self.plane_elems(0);
        let w = self.row_elems(0);
        let page = start / p;
        let view =
            match (self.kind, self.layout) {
                (PoolKind::AsymmetricMha, _) => return Err(Error::not_implemented(
                    "Models with head_dim != v_head_dim do not support the flat-page interface \
                     used by HiCache L3 storage backends {hf3fs, eic, nixl}. Use a backend that \
                     does not use this interface (e.g. mooncake, simm).",
                )),
                (PoolKind::V4Paged, Layout::LayerFirst) => PageView {
                    offset: start * w,
                    shape: vec![l, w],
                    strides: vec![s * w, 1],
                },
                (PoolKind::V4Paged, Layout::PageFirst) => PageView {
                    offset: start * l * w,
                    shape: vec![l, w],
                    strides: vec![w, 1],
                },
                (PoolKind::V4Paged, _) => PageView {
                    offset: start * l * w,
                    shape: vec![l, 1, w],
                    strides: vec![w, w, 1],
                },
                (PoolKind::Mla, Layout::LayerFirst) => PageView {
                    offset: start * w,
                    shape: vec![l, p, 1, w],
                    strides: vec![s * w, w, w, 1],
                },
                (PoolKind::Mla, Layout::PageFirst) => PageView {
                    offset: start * l * w,
                    shape: vec![p, l, 1, w],
                    strides: vec![l * w, w, w, 1],
                },
                (PoolKind::Mla, _) => PageView {
                    offset: page * l * p * w,
                    shape: vec![1, l, p, 1, w],
                    strides: vec![l * p * w, p * w, w, w, 1],
                },
                (PoolKind::Mha, layout) => {
                    let (h, d) = (self.heads, self.dims[0]);
                    let mut v = match layout {
                        Layout::LayerFirst => PageView {
                            offset: start * h * d,
                            shape: vec![l, p, h, d],
                            strides: vec![s * h * d, h * d, d, 1],
                        },
                        Layout::PageFirst => PageView {
                            offset: start * l * h * d,
                            shape: vec![p, l, h, d],
                            strides: vec![l * h * d, h * d, d, 1],
                        },
                        Layout::PageFirstDirect => PageView {
                            offset: page * l * p * h * d,
                            shape: vec![1, l, p, h, d],
                            strides: vec![l * p * h * d, p * h * d, h * d, d, 1],
                        },
                        Layout::PageHead => PageView {
                            offset: page * h * p * l * d,
                            shape: vec![1, h, p, l, d],
                            strides: vec![h * p * l * d, p * l * d, l * d, d, 1],
                        },
                        Layout::PageUnified => unreachable!("refused above"),
                    };
                    v.shape.insert(0, 2);
                    v.strides.insert(0, plane_elems);
                    v
                }
            };
        Ok(view)
    }

    /// `get_contiguous_buf_infos` (MLA, V4): per-layer (host address, bytes, item bytes) as
    /// SGLang reports them (for the page layouts its per-layer entries are SGLang's quirks:
    /// MLA page_first a strided layer view; page_first_direct a page slab).
    pub fn contiguous_buf_infos(&self, base: u64) -> Result<(Vec<u64>, Vec<u64>, Vec<u64>)> {
        let (l, s, p, t) = (self.layers, self.rows, self.page_size, self.item_bytes(0));
        match (self.kind, self.layout) {
            (PoolKind::V4Paged, Layout::LayerFirst) => Ok((
                (0..l).map(|layer| base + layer * s * t).collect(),
                vec![s * t; l as usize],
                vec![t; l as usize],
            )),
            // 0.5.20+ lists the pointers of `data_refs`, which the page layouts leave empty,
            // and still sizes `kv_buffer[i]` for each layer i: page row i's bytes.
            (PoolKind::V4Paged, _) if self.release.is_none_or(|r| r >= (0, 5, 20)) => {
                if s < l {
                    // SGLang fails indexing kv_buffer[i] there (an IndexError).
                    return Err(Error::page_index(format!(
                        "{} get_contiguous_buf_infos: kv_buffer has {s} page rows but the pool \
                         has {l} layers, and SGLang sizes kv_buffer[i] for each layer i (page \
                         row {s} is outside the pool; layout {:?})",
                        self.name,
                        self.layout.name()
                    )));
                }
                Ok((Vec::new(), vec![l * t; l as usize], vec![t; l as usize]))
            }
            // Before 0.5.20 SGLang fails there on `data_ptrs = None`.
            (PoolKind::V4Paged, layout) => Err(Error::value(format!(
                "{} get_contiguous_buf_infos requires layer_first layout, got {}",
                self.name,
                layout.name()
            ))),
            (PoolKind::Mla, layout) => {
                // (stride between the per-layer views, kv_buffer[l]'s bytes, kv_buffer's dim 0)
                let (ptr, len, dim0) = match layout {
                    Layout::LayerFirst => (s * t, s * t, l),
                    // kv_buffer[l] is a token row (L * T bytes); the layer view starts at l * T.
                    Layout::PageFirst => (t, l * t, s),
                    // kv_buffer[l] is page l's slab.
                    _ => (l * p * t, l * p * t, self.page_num()),
                };
                if dim0 < l {
                    // SGLang fails indexing kv_buffer[l] there (an IndexError).
                    return Err(Error::page_index(format!(
                        "get_contiguous_buf_infos: kv_buffer has {dim0} entries along dim 0 but \
                         the pool has {l} layers, and SGLang reads kv_buffer[l] for each layer l \
                         (entry {dim0} is outside the pool; layout {:?})",
                        layout.name()
                    )));
                }
                Ok((
                    (0..l).map(|layer| base + layer * ptr).collect(),
                    vec![len; l as usize],
                    vec![t * p; l as usize],
                ))
            }
            _ => Err(Error::value(
                "get_contiguous_buf_infos is defined for MLA and DeepSeek V4 pools",
            )),
        }
    }
}

/// SGLang 0.5.23's `PageUnifiedLayout` (`pool_host/page_unified.py`): its checks with their texts,
/// and the sizes and L3 chunk spans derived from it. Per page the bytes are
/// `(head_group, layer, component, page_size, heads_in_group, head_dim)`; the planes' offsets are
/// [`PlaneLayout`]'s.
pub mod unified {
    use crate::error::{Error, Result};

    /// The layout's repr inside SGLang's texts.
    fn repr(fields: &[(&str, i64); 6], mla: bool) -> String {
        let inner: Vec<String> = fields.iter().map(|(n, v)| format!("{n}={v}")).collect();
        let mla = if mla { "True" } else { "False" };
        format!("PageUnifiedLayout({}, is_mla={mla})", inner.join(", "))
    }

    /// `PageUnifiedLayout.__post_init__`, in its order; the fields are SGLang's, in its order
    /// (`page_size, layer_num, head_num, head_group_num, head_dim, itemsize`).
    pub fn check(fields: [i64; 6], mla: bool) -> Result<()> {
        let named = [
            ("page_size", fields[0]),
            ("layer_num", fields[1]),
            ("head_num", fields[2]),
            ("head_group_num", fields[3]),
            ("head_dim", fields[4]),
            ("itemsize", fields[5]),
        ];
        if let Some((name, _)) = named.iter().find(|(_, v)| *v <= 0) {
            return Err(Error::value(format!(
                "{name} must be positive: {}",
                repr(&named, mla)
            )));
        }
        let [_, _, heads, groups, dim, itemsize] = fields;
        if heads % groups != 0 {
            return Err(Error::value(format!(
                "head_group_num={groups} must divide the pool's {heads} kv heads."
            )));
        }
        if mla && (groups != 1 || heads != 1) {
            return Err(Error::value(format!(
                "MLA page blocks have no head axis: {}",
                repr(&named, mla)
            )));
        }
        let group_bytes = (heads / groups) as i128 * dim as i128 * itemsize as i128;
        if group_bytes % 16 != 0 {
            return Err(Error::value(format!(
                "one head group's token row is {group_bytes} bytes, which the page_unified \
                 transfer kernels cannot move: they require a multiple of 16. Raise head_dim, \
                 lower head_group_num, or use another --hicache-mem-layout."
            )));
        }
        Ok(())
    }

    /// The derived sizes of a page_unified pool (all in bytes).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Unified {
        /// 2 (K, V) for MHA, 1 for MLA.
        pub components: u64,
        pub page_size: u64,
        pub layers: u64,
        pub head_groups: u64,
        /// One head group's row for one token: the copy unit.
        pub group_bytes: u64,
    }

    impl Unified {
        /// One (group, layer) cell: every component of every token of the page.
        pub fn layer_bytes(&self) -> u64 {
            self.components * self.page_size * self.group_bytes
        }

        pub fn head_group_bytes(&self) -> u64 {
            self.layers * self.layer_bytes()
        }

        pub fn bytes_per_page(&self) -> u64 {
            self.head_groups * self.head_group_bytes()
        }

        /// `chunk_span((start, end), head_group)`: the byte span, inside one page, of the L3
        /// chunk holding pool-local layers `[start, end)` of one head group (one contiguous run).
        pub fn chunk_span(&self, start: i64, end: i64, head_group: i64) -> Result<(u64, u64)> {
            let layers = self.layers as i64;
            if !(0 <= start && start < end && end <= layers) {
                return Err(Error::value(format!(
                    "layer range ({start}, {end}) is not a non-empty sub-range of [0, {layers})."
                )));
            }
            if !(0..self.head_groups as i64).contains(&head_group) {
                return Err(Error::value(format!(
                    "head group {head_group} is outside [0, {}).",
                    self.head_groups
                )));
            }
            Ok((
                head_group as u64 * self.head_group_bytes() + start as u64 * self.layer_bytes(),
                (end - start) as u64 * self.layer_bytes(),
            ))
        }
    }
}

/// The DeepSeek V4 C4 page row SGLang's token-granular kernel (`transfer_cache_dsv4_mla`)
/// assumes whatever the pool says: 64 tokens, each a 576-byte value and an 8-byte scale, the
/// values first, the row padded to a multiple of 576 bytes.
pub mod c4 {
    pub const PAGE_TOKENS: u64 = 64;
    pub const VALUE_BYTES: u64 = 576;
    pub const SCALE_BYTES: u64 = 8;
    /// 37440: ceil((576 + 8) * 64 / 576) * 576.
    pub const ROW_BYTES: u64 =
        ((VALUE_BYTES + SCALE_BYTES) * PAGE_TOKENS).div_ceil(VALUE_BYTES) * VALUE_BYTES;
    pub const VALUES_PER_ROW: u64 = ROW_BYTES / VALUE_BYTES;
    pub const SCALES_PER_ROW: u64 = ROW_BYTES / SCALE_BYTES;
    pub const SCALE_FIRST: u64 = VALUE_BYTES * PAGE_TOKENS / SCALE_BYTES;

    /// Token `t`'s value as a row of 576-byte units (the formula written out; transfers read
    /// it through `IndexMap::C4Value`, and tests compare the two).
    #[cfg(test)]
    pub fn value_row(t: u64) -> u64 {
        (t / PAGE_TOKENS) * VALUES_PER_ROW + t % PAGE_TOKENS
    }

    /// Token `t`'s scale as a row of 8-byte units (see `value_row`).
    #[cfg(test)]
    pub fn scale_row(t: u64) -> u64 {
        (t / PAGE_TOKENS) * SCALES_PER_ROW + SCALE_FIRST + t % PAGE_TOKENS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: PoolKind, layout: &str, dims: &[usize]) -> PoolSpec {
        // 5 layers, 3 pages of 4 tokens, 2 heads, bf16 (V4: 3 rows of slot page 4).
        PoolSpec::new(kind, layout, 5, 12, 4, 2, dims, 2, 1, 0, "c4").unwrap()
    }

    #[test]
    fn allocations_registration_units_and_layer_views() {
        use PoolKind::*;
        // 5 layers x 4 tokens x 2 heads x 8 dims x bf16: a page of one plane is 640 bytes.
        let mha = |layout| spec(Mha, layout, &[8, 8]);
        let lf = mha("layer_first");
        let (shapes, planes) = lf.allocations();
        assert_eq!(shapes, vec![vec![2, 5, 12, 2, 8]]);
        assert_eq!(planes, vec![(0, 0), (0, 5 * 12 * 32)]);
        assert_eq!(lf.registration_unit(0), 0);
        assert_eq!(lf.page_strides(), None);
        assert_eq!(lf.layer_view_dim(true), Some(0));
        let pf = mha("page_first");
        assert_eq!(pf.registration_unit(0), 640);
        assert_eq!(pf.page_strides(), Some(vec![640, 640]));
        assert_eq!(pf.layer_view_dim(false), Some(1));
        let direct = mha("page_first_direct");
        assert_eq!(direct.layer_view_dim(false), Some(0));
        assert_eq!(direct.layer_view_dim(true), Some(1));
        let head = mha("page_head");
        assert_eq!(
            (head.registration_unit(0), head.page_strides()),
            (0, Some(vec![640, 640]))
        );
        let unified =
            PoolSpec::grouped(Mha, "page_unified", 5, 12, 4, 2, 2, &[8, 8], 2, 1, 0, "").unwrap();
        let (shapes, planes) = unified.allocations();
        assert_eq!((shapes.len(), planes), (1, vec![(0, 0), (0, 0)]));
        // The fused block: both components of every layer of one page.
        assert_eq!(unified.registration_unit(0), 2 * 640);
        assert_eq!(
            (unified.page_strides(), unified.layer_view_dim(true)),
            (None, None)
        );
        let asym = spec(AsymmetricMha, "page_first_direct", &[8, 4]);
        let (shapes, planes) = asym.allocations();
        assert_eq!(shapes.len(), 2);
        assert_eq!(planes, vec![(0, 0), (1, 0)]);
        assert_eq!(
            (asym.registration_unit(0), asym.registration_unit(1)),
            (640, 320)
        );
        let mla = spec(Mla, "page_first_direct", &[8]);
        assert_eq!(mla.layer_view_dim(true), Some(0));
        assert_eq!(mla.registration_unit(0), 5 * 4 * 16);
        assert_eq!(spec(Mla, "layer_first", &[8]).page_strides(), None);
        // V4: page rows of 7 bytes; layer_first must not split one row, the others one page row.
        let v4 = |layout| PoolSpec::new(V4Paged, layout, 5, 3, 4, 1, &[7], 1, 1, 0, "").unwrap();
        assert_eq!(v4("layer_first").registration_unit(0), 7);
        assert_eq!(v4("page_first").registration_unit(0), 35);
        assert_eq!(v4("page_first_direct").page_strides(), Some(vec![35]));
        // SGLang's V4 per-layer host buffers, staging buffer and C4 token rows: one layout each.
        let shapes = |layout| {
            let s = v4(layout);
            (s.layer_view_dim(false), s.staging_shape(), s.token_rows())
        };
        assert_eq!(shapes("layer_first"), (Some(0), None, false));
        assert_eq!(shapes("page_first"), (None, Some(vec![3, 5, 7]), false));
        assert_eq!(shapes("page_first_direct"), (None, None, false));
        let c4 = |layout, page, row| {
            let rows = 100;
            let s = PoolSpec::new(V4Paged, layout, 2, rows, page, 1, &[row], 1, 1, 0, "").unwrap();
            (s.token_rows(), s.staging_shape())
        };
        let row = c4::ROW_BYTES as usize;
        assert_eq!(c4("layer_first", 64, row), (true, None));
        assert_eq!(c4("layer_first", 32, row), (false, None));
        assert_eq!(c4("layer_first", 64, row - 1), (false, None));
        assert_eq!(
            c4("page_first", 64, row),
            (false, Some(vec![64, 2, row as u64]))
        );
    }

    #[test]
    fn a_flat_page_inside_a_page_covers_two_of_a_slot_major_layout() {
        use PoolKind::*;
        // 3 pages of 4 slots.
        assert_eq!(
            spec(Mha, "layer_first", &[8, 8])
                .flat_page_pages(1)
                .unwrap(),
            vec![0, 1]
        );
        assert_eq!(
            spec(Mha, "page_first", &[8, 8]).flat_page_pages(4).unwrap(),
            vec![1]
        );
        assert_eq!(
            spec(Mla, "page_first", &[8]).flat_page_pages(8).unwrap(),
            vec![2]
        );
        assert_eq!(
            spec(Mha, "page_first_direct", &[8, 8])
                .flat_page_pages(5)
                .unwrap(),
            vec![1]
        );
        assert_eq!(
            spec(Mha, "page_head", &[8, 8]).flat_page_pages(4).unwrap(),
            vec![1]
        );
        assert!(spec(Mha, "layer_first", &[8, 8])
            .flat_page_pages(9)
            .is_err());
        // V4: a slot names its page row.
        assert_eq!(
            spec(V4Paged, "page_first", &[7])
                .flat_page_pages(9)
                .unwrap(),
            vec![2]
        );
        // DCP (MLA, 2 ranks): logical page 1 starts at logical slot 8 and is page 1 here.
        let dcp = PoolSpec::new(Mla, "page_first", 5, 12, 4, 1, &[8], 2, 2, 1, "").unwrap();
        assert_eq!(dcp.flat_page_pages(8).unwrap(), vec![1]);
    }

    #[test]
    fn dummy_pages_have_sglangs_shapes_in_every_layout() {
        use PoolKind::*;
        for layout in [
            "layer_first",
            "page_first",
            "page_first_direct",
            "page_unified",
        ] {
            // The page SGLang zero-fills is the same in every layout: only the copy differs.
            assert_eq!(
                spec(Mha, layout, &[8, 8]).dummy_page_shape(),
                Some(vec![2, 5, 4, 2, 8])
            );
            assert_eq!(
                spec(Mla, layout, &[8]).dummy_page_shape(),
                Some(vec![5, 4, 1, 8])
            );
        }
        assert_eq!(
            spec(AsymmetricMha, "page_first", &[8, 4]).dummy_page_shape(),
            None
        );
        assert_eq!(
            spec(V4Paged, "page_first", &[7]).dummy_page_shape(),
            Some(vec![5, 7])
        );
    }

    #[test]
    fn supported_pairs_are_the_contracts_matrix() {
        use Backend::{Direct as D, Kernel as K};
        use Layout::*;
        let pairs = |k| support::served_pairs(k);
        // host-pool-contract §3.2-3.5.
        assert_eq!(
            pairs(PoolKind::Mha),
            vec![
                (LayerFirst, K),
                (LayerFirst, D),
                (PageFirst, K),
                (PageFirstDirect, D),
                (PageHead, K),
                (PageUnified, K)
            ]
        );
        assert_eq!(
            pairs(PoolKind::AsymmetricMha),
            vec![(PageFirst, K), (PageFirstDirect, D)]
        );
        let mla = vec![
            (LayerFirst, K),
            (LayerFirst, D),
            (PageFirst, K),
            (PageFirstDirect, D),
            (PageUnified, K),
        ];
        assert_eq!(pairs(PoolKind::Mla), mla);
        assert_eq!(pairs(PoolKind::V4Paged), mla[..4]);
    }

    #[test]
    fn construction_refuses_layouts_with_sglangs_text() {
        let e = PoolSpec::new(
            PoolKind::Mha,
            "page_first_kv_split",
            1,
            4,
            4,
            1,
            &[8, 8],
            2,
            1,
            0,
            "",
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "Unsupported layout: page_first_kv_split");
        let e = PoolSpec::new(
            PoolKind::V4Paged,
            "page_unified",
            1,
            4,
            4,
            1,
            &[8],
            1,
            1,
            0,
            "",
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "Unsupported layout: page_unified");
        let e = PoolSpec::new(
            PoolKind::AsymmetricMha,
            "layer_first",
            1,
            4,
            4,
            1,
            &[8, 4],
            2,
            1,
            0,
            "",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Unsupported layout for models with head_dim != v_head_dim: layer_first; expected \
             'page_first' or 'page_first_direct'."
        );
        let e =
            PoolSpec::new(PoolKind::Mla, "page_head", 1, 4, 4, 1, &[8], 2, 1, 0, "").unwrap_err();
        assert_eq!(e.to_string(), "Unsupported layout: page_head");
    }

    /// SGLang 0.5.23's `PageUnifiedLayout`: page_dims, strides, chunk spans and refusals, from
    /// its own unit test's cases (`test_page_unified_layout.py`).
    #[test]
    fn page_unified_is_sglangs_layout() {
        let mha = |layers, heads, groups, dim, itemsize| {
            PoolSpec::grouped(
                PoolKind::Mha,
                "page_unified",
                layers,
                12,
                4,
                heads,
                groups,
                &[dim, dim],
                itemsize,
                1,
                0,
                "",
            )
        };
        // A plane count that does not fit the kind is refused before page_unified's own checks
        // read the first plane's width.
        for kind in [PoolKind::Mha, PoolKind::Mla] {
            let e = PoolSpec::grouped(kind, "page_unified", 2, 8, 2, 4, 2, &[], 2, 1, 0, "")
                .unwrap_err();
            assert!(e.to_string().contains("plane(s), got 0 dims"), "{e}");
        }
        // P=4, L=6, H=4, G=2, D=8, bf16.
        let s = mha(6, 4, 2, 8, 2).unwrap();
        assert_eq!(s.shape(0), vec![3, 2, 6, 2, 4, 2, 8]);
        assert_eq!(s.shape(1), s.shape(0));
        let u = s.unified().unwrap();
        assert_eq!(
            (
                u.group_bytes,
                u.layer_bytes(),
                u.head_group_bytes(),
                u.bytes_per_page()
            ),
            (32, 256, 1536, 3072)
        );
        assert_eq!(s.plane_elems(0) * 2, 3 * 3072);
        assert_eq!(u.chunk_span(1, 3, 1).unwrap(), (1792, 512));
        for (range, group, text) in [
            (
                (0, 7),
                0,
                "layer range (0, 7) is not a non-empty sub-range of [0, 6).",
            ),
            (
                (3, 3),
                0,
                "layer range (3, 3) is not a non-empty sub-range of [0, 6).",
            ),
            ((-1, 1), 0, "layer range (-1, 1)"),
            ((0, 1), 2, "head group 2 is outside [0, 2)."),
        ] {
            let e = u.chunk_span(range.0, range.1, group).unwrap_err();
            assert!(e.to_string().starts_with(text), "{e}");
        }
        // bytes_per_page does not depend on the group count.
        for g in [1, 2, 4, 8] {
            let s = mha(6, 8, g, 8, 2).unwrap();
            assert_eq!(s.unified().unwrap().bytes_per_page(), 2 * 6 * 4 * 8 * 8 * 2);
        }
        let e = mha(6, 2, 2, 7, 1).unwrap_err();
        assert!(e.to_string().contains("multiple of 16"), "{e}");
        let e = mha(6, 6, 4, 8, 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "head_group_num=4 must divide the pool's 6 kv heads."
        );
        let e = mha(0, 2, 1, 8, 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "layer_num must be positive: PageUnifiedLayout(page_size=4, layer_num=0, head_num=2, \
             head_group_num=1, head_dim=8, itemsize=2, is_mla=False)"
        );
        // MLA: (pages, L, P, D), one component, the bytes of page_first_direct.
        let m = PoolSpec::new(
            PoolKind::Mla,
            "page_unified",
            61,
            448,
            64,
            1,
            &[576],
            2,
            1,
            0,
            "",
        )
        .unwrap();
        assert_eq!(m.shape(0), vec![7, 61, 64, 576]);
        let u = m.unified().unwrap();
        assert_eq!(u.components, 1);
        assert_eq!(u.chunk_span(0, 61, 0).unwrap(), (0, u.bytes_per_page()));
        assert_eq!(u.bytes_per_page(), 61 * 64 * 576 * 2);
        // Transfers through the kernels only; no page metadata or flat pages, as in SGLang.
        assert_eq!(
            s.check_pair(Some("kernel"), "kernel").unwrap(),
            Backend::Kernel
        );
        let e = s.check_pair(Some("direct"), "direct").unwrap_err();
        // SGLang's pool text (its controller, which refuses the pair first, says "Unsupported
        // layout 'page_unified' for io backend 'direct'").
        assert_eq!(e.to_string(), "Unsupported layout: page_unified");
        let e = s.page_view(0).unwrap_err();
        assert_eq!(e.to_string(), "Unsupported layout: page_unified");
        assert!(s.page_meta(&[0, 0], &[0]).is_err());
    }

    #[test]
    fn pairs_and_texts_per_kind() {
        let ok = |k, l: &str, dims: &[usize], b: &str| spec(k, l, dims).check_pair(Some(b), b);
        for (l, b) in [
            ("layer_first", "kernel"),
            ("page_first", "kernel"),
            ("page_head", "kernel"),
            ("layer_first", "direct"),
            ("page_first_direct", "direct"),
        ] {
            assert!(ok(PoolKind::Mha, l, &[8, 8], b).is_ok(), "{l} {b}");
        }
        let err = |k, l: &str, dims: &[usize], b: Option<&str>, shown: &str| {
            spec(k, l, dims)
                .check_pair(b, shown)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(
                PoolKind::Mha,
                "page_first",
                &[8, 8],
                Some("direct"),
                "direct"
            ),
            "Unsupported layout: page_first"
        );
        assert_eq!(
            err(
                PoolKind::Mha,
                "page_first_direct",
                &[8, 8],
                Some("kernel_ascend"),
                "kernel_ascend"
            ),
            "Unsupported IO backend: kernel_ascend"
        );
        assert_eq!(
            err(
                PoolKind::Mha,
                "page_first",
                &[8, 8],
                Some("kernel_ascend"),
                "kernel_ascend"
            ),
            "Unsupported layout: page_first"
        );
        assert_eq!(
            err(
                PoolKind::Mla,
                "page_first_direct",
                &[8],
                Some("kernel_ascend"),
                "kernel_ascend"
            ),
            "Unsupported layout: page_first_direct"
        );
        assert_eq!(
            err(PoolKind::Mla, "layer_first", &[8], None, "['kernel']"),
            "Unsupported IO backend: ['kernel']"
        );
        assert_eq!(
            err(
                PoolKind::AsymmetricMha,
                "page_first",
                &[8, 4],
                Some("direct"),
                "direct"
            ),
            "Unsupported layout for models with head_dim != v_head_dim and io_backend='direct': \
             page_first; expected 'page_first_direct'."
        );
        assert_eq!(
            err(
                PoolKind::V4Paged,
                "page_first",
                &[24],
                Some("direct"),
                "direct"
            ),
            "Unsupported V4 paged host layout/backend: page_first/direct"
        );
    }

    /// Pointers straight from the contract's table (§4.5), written independently of the code.
    #[test]
    fn page_meta_matches_the_contract() {
        let (l, s, p, h, d, e) = (5u64, 12u64, 4u64, 2u64, 8u64, 2u64);
        let t = h * d * e;
        let base = 1 << 20;
        let vo = l * s * t;
        let m = spec(PoolKind::Mha, "layer_first", &[8, 8]);
        let starts = m.page_starts(&[4, 5, 6, 7, 0, 1, 2, 3]).unwrap();
        let (ptrs, sizes) = m.page_meta(&[base, base + vo], &starts).unwrap();
        let mut want = vec![];
        for tok in [4u64, 0] {
            for layer in 0..l {
                let k = base + tok * t + layer * s * t;
                want.extend([k, k + vo]);
            }
        }
        assert_eq!(ptrs, want);
        assert!(sizes.iter().all(|&z| z == p * t));
        let m = spec(PoolKind::Mha, "page_head", &[8, 8]);
        let (ptrs, sizes) = m.page_meta(&[base, base + vo], &[8]).unwrap();
        assert_eq!(ptrs, vec![base + 8 * l * t, base + vo + 8 * l * t]);
        assert_eq!(sizes, vec![l * p * t; 2]);
        let page_8: Vec<i64> = (8..8 + p as i64).collect();
        let (ptrs, sizes) = m.split_heads_meta(&[base, base + vo], &page_8, 2).unwrap();
        let k0 = base + 8 * l * h * d * e;
        let k1 = k0 + p * l * d * e;
        assert_eq!(ptrs, vec![k0, k0 + vo, k1, k1 + vo]);
        assert_eq!(sizes, vec![l * p * h * d * e / 2; 4]);
        let a = spec(PoolKind::AsymmetricMha, "page_first_direct", &[8, 4]);
        let (ptrs, sizes) = a.page_meta(&[base, 7 << 20], &[4]).unwrap();
        assert_eq!(ptrs, vec![base + 4 * l * t, (7 << 20) + 4 * l * (t / 2)]);
        assert_eq!(sizes, vec![l * p * t, l * p * t / 2]);
    }

    #[test]
    fn page_starts_are_checked() {
        let m = spec(PoolKind::Mha, "page_first_direct", &[8, 8]);
        assert_eq!(
            m.page_starts(&[1, 2, 3]).unwrap_err().to_string(),
            "3 indices is not a multiple of the page size 4"
        );
        assert_eq!(
            m.page_starts(&[2, 3, 4, 5]).unwrap_err().to_string(),
            "slot 2 is not the first slot of a page (page size 4)"
        );
        assert_eq!(
            m.page_starts(&[12, 13, 14, 15]).unwrap_err().to_string(),
            "page starting at slot 12 does not fit in the host pool of 12 slots"
        );
        let v4 = spec(PoolKind::V4Paged, "layer_first", &[24]);
        assert_eq!(v4.page_starts(&[8, 9, 10, 11]).unwrap(), vec![2]);
        assert_eq!(
            v4.page_starts(&[48, 49, 50, 51]).unwrap_err().to_string(),
            "c4 page index 48 out of range [0, 48)"
        );
    }

    #[test]
    fn dcp_pages_are_the_rank_local_page() {
        let m = PoolSpec::new(PoolKind::Mla, "page_first", 3, 8, 4, 1, &[8], 2, 2, 1, "").unwrap();
        assert_eq!(m.logical_page_size(), 8);
        assert_eq!(m.data_page_start(8).unwrap(), 4);
        assert_eq!(
            m.data_page_start(4).unwrap_err().to_string(),
            "DCP L3 page start must be a nonnegative logical page boundary."
        );
        assert_eq!(
            m.data_page_start(16).unwrap_err().to_string(),
            "DCP L3 page is outside the host pool."
        );
        assert_eq!(
            m.page_starts(&(8..16).collect::<Vec<_>>()).unwrap(),
            vec![4]
        );
    }

    #[test]
    fn page_views_address_the_page() {
        // MHA page_first: (2, P, L, H, D) with the V plane L*S*H*D elements after K.
        let m = spec(PoolKind::Mha, "page_first", &[8, 8]);
        let v = m.page_view(4).unwrap();
        assert_eq!(v.shape, vec![2, 4, 5, 2, 8]);
        assert_eq!(v.strides, vec![5 * 12 * 16, 5 * 16, 16, 8, 1]);
        assert_eq!(v.offset, 4 * 5 * 16);
        let v = spec(PoolKind::Mla, "page_first_direct", &[8])
            .page_view(8)
            .unwrap();
        assert_eq!(v.shape, vec![1, 5, 4, 1, 8]);
        assert_eq!(v.offset, 2 * 5 * 4 * 8);
        assert!(spec(PoolKind::AsymmetricMha, "page_first", &[8, 4])
            .page_view(0)
            .is_err());
    }

    /// Adversarial geometry: every combination of extreme sizes is an error or a spec whose
    /// derived values never overflow; nothing panics (debug builds trap on overflow).
    #[test]
    fn adversarial_geometry_never_panics() {
        let big = [
            0usize,
            1,
            3,
            1 << 20,
            1 << 31,
            1 << 40,
            (1 << 62) + 1,
            usize::MAX,
        ];
        let mut built = 0;
        for kind in [
            PoolKind::Mha,
            PoolKind::AsymmetricMha,
            PoolKind::Mla,
            PoolKind::V4Paged,
        ] {
            let dims: &[usize] = match kind {
                PoolKind::Mha | PoolKind::AsymmetricMha => &[3, 5],
                _ => &[7],
            };
            for layout in [
                "layer_first",
                "page_first",
                "page_first_direct",
                "page_head",
            ] {
                for &layers in &big {
                    for &rows in &big {
                        for &page in &[0usize, 1, 3, 1 << 30, usize::MAX] {
                            let r = PoolSpec::new(
                                kind, layout, layers, rows, page, 2, dims, 2, 1, 0, "x",
                            );
                            let Ok(spec) = r else { continue };
                            built += 1;
                            for plane in 0..dims.len() {
                                let _ = spec.shape(plane);
                            }
                            for index in [i64::MIN, -1, 0, 1, i64::MAX] {
                                if let Ok(start) = spec.data_page_start(index) {
                                    let _ = spec.page_view(start);
                                }
                            }
                            let idx: Vec<i64> = vec![0; page.min(4)];
                            if let Ok(starts) = spec.page_starts(&idx) {
                                let _ = spec.page_meta(&[0, 0], &starts);
                            }
                            let _ = spec.contiguous_buf_infos(0);
                        }
                    }
                }
            }
        }
        assert!(built > 50, "{built}");
    }

    #[test]
    fn c4_rows_match_sglangs_kernel() {
        assert_eq!(c4::ROW_BYTES, 37440);
        assert_eq!(c4::value_row(65), 65 + 1);
        assert_eq!(c4::scale_row(0), 4608);
        assert_eq!(c4::scale_row(64 + 3), 4680 + 4608 + 3);
    }
}
