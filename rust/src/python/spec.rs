//! `_core.PoolSpec`: a pool's geometry in SGLang's terms (shapes, pair checks, page metadata).

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::args::{int_in, py_int};
use super::errors::{to_py, value_err};
use crate::pool::{PoolKind, PoolSpec};
use crate::request::Layout;

/// A host pool's geometry in SGLang's terms, and everything derived from it (`pool::PoolSpec`):
/// buffer shapes, the (layout, io_backend) check with SGLang's texts, L3 page metadata and views.
#[pyclass(frozen, module = "hostkv_rs._core", name = "PoolSpec")]
pub struct PyPoolSpec {
    pub(crate) spec: PoolSpec,
}

/// The layout argument's name: a string, or for anything else (which SGLang compares with each
/// layout's name, and so refuses) SGLang's refusal for a pool of `kind`, showing the argument as
/// Python does (`Unsupported layout: None`).
pub(super) fn layout_name(
    py: Python<'_>,
    kind: PoolKind,
    layout: &Bound<'_, PyAny>,
) -> PyResult<String> {
    // A string that is no UTF-8 (a lone surrogate) names no layout either.
    match layout.cast::<PyString>().map(|name| name.to_cow()) {
        Ok(Ok(name)) => Ok(name.into_owned()),
        _ => {
            let shown = layout.str()?.to_string_lossy().into_owned();
            Err(to_py(py, crate::support::refused_layout(kind, &shown)))
        }
    }
}

fn u64s(v: &[u64]) -> Vec<u64> {
    v.to_vec()
}

#[pymethods]
impl PyPoolSpec {
    /// `release`: the SGLang release the pool follows, `(major, minor, patch)`; a layout that
    /// release does not build yet is refused with its text (None: the newest release).
    #[new]
    #[pyo3(signature = (kind, layout, num_layers, rows, page_size, dims, itemsize, head_num = None, dcp_size = None, dcp_rank = None, name = "", head_group_num = None, release = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kind: &str,
        layout: &Bound<'_, PyAny>,
        num_layers: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        dims: Vec<Bound<'_, PyAny>>,
        itemsize: &Bound<'_, PyAny>,
        head_num: Option<&Bound<'_, PyAny>>,
        dcp_size: Option<&Bound<'_, PyAny>>,
        dcp_rank: Option<&Bound<'_, PyAny>>,
        name: &str,
        head_group_num: Option<&Bound<'_, PyAny>>,
        release: Option<crate::support::Release>,
    ) -> PyResult<Self> {
        let kind = PoolKind::parse(kind).map_err(|e| to_py(py, e))?;
        let layout = &layout_name(py, kind, layout)?;
        let size = |v: &Bound<'_, PyAny>, n: &str| -> PyResult<usize> {
            Ok(int_in(v, n, 0, i64::MAX as u128, "[0, 2**63)")? as usize)
        };
        let or_one = |v: Option<&Bound<'_, PyAny>>, n: &str| v.map_or(Ok(1), |v| size(v, n));
        let num_layers = size(num_layers, "num_layers")?;
        let rows = size(rows, "rows")?;
        let page_size = size(page_size, "page_size")?;
        let dims = dims
            .iter()
            .map(|d| size(d, "dims"))
            .collect::<PyResult<Vec<_>>>()?;
        let itemsize = size(itemsize, "itemsize")?;
        let head_num = or_one(head_num, "head_num")?;
        let dcp_size = or_one(dcp_size, "dcp_size")?;
        let dcp_rank = dcp_rank.map_or(Ok(0), |v| size(v, "dcp_rank"))?;
        // Read only where the layout uses it: SGLang never looks at it for other layouts.
        let head_groups = match head_group_num {
            Some(v) if Layout::parse(layout).is_ok_and(Layout::groups_heads) => {
                let negative = py_int(v, "head_group_num")?
                    .extract::<i64>()
                    .ok()
                    .filter(|&g| g < 0);
                match negative {
                    // SGLang's page_unified layout refuses it naming every field (MHA only:
                    // MLA has no head groups, and ignores the argument).
                    Some(g) if kind != PoolKind::Mla => {
                        let field = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
                        let dim = dims.first().copied().unwrap_or(0);
                        let (p, l, h) = (field(page_size), field(num_layers), field(head_num));
                        crate::pool::unified::check(
                            [p, l, h, g, field(dim), field(itemsize)],
                            false,
                        )
                        .map_err(|e| to_py(py, e))?;
                        1
                    }
                    Some(_) => 1,
                    None => size(v, "head_group_num")?,
                }
            }
            _ => 1,
        };
        // The SGLang release the pool follows may not have this layout yet.
        crate::support::check_release(kind, layout, release).map_err(|e| to_py(py, e))?;
        let mut spec = PoolSpec::grouped(
            kind,
            layout,
            num_layers,
            rows,
            page_size,
            head_num,
            head_groups,
            &dims,
            itemsize,
            dcp_size,
            dcp_rank,
            name,
        )
        .map_err(|e| to_py(py, e))?;
        spec.release = release;
        Ok(Self { spec })
    }

    /// Element shape of plane `plane` (SGLang's tensor shape).
    fn shape(&self, plane: usize) -> PyResult<Vec<u64>> {
        self.check_plane(plane)?;
        Ok(self.spec.shape(plane))
    }

    /// Bytes of one row of one layer, per plane (`token_stride_size`; the V4 row).
    #[getter]
    fn item_bytes(&self) -> Vec<u64> {
        (0..self.spec.planes().len())
            .map(|p| self.spec.item_bytes(p))
            .collect()
    }

    /// Bytes of each plane.
    #[getter]
    fn plane_nbytes(&self) -> Vec<u64> {
        self.spec.planes().iter().map(|p| p.nbytes).collect()
    }

    #[getter]
    fn page_num(&self) -> u64 {
        self.spec.page_num()
    }

    /// The support table's check of a transfer (`transfer`: "slots", "tokens" for DeepSeek V4's
    /// token-granular path, "sharded_backup" for a layer-sharded MLA backup): the engine backend
    /// it runs on ("kernel" or "direct"), or ValueError with SGLang's text (whatever
    /// `io_backend` is).
    #[pyo3(signature = (io_backend, transfer = "slots"))]
    pub(super) fn check_pair(
        &self,
        py: Python<'_>,
        io_backend: &Bound<'_, PyAny>,
        transfer: &str,
    ) -> PyResult<&'static str> {
        let transfer = crate::support::Transfer::parse(transfer).map_err(|e| to_py(py, e))?;
        let text = io_backend.cast::<pyo3::types::PyString>().ok();
        let name = text.map(|t| t.to_cow()).transpose()?;
        let shown = io_backend.str()?.to_cow()?.into_owned();
        self.spec
            .route(name.as_deref(), &shown, transfer)
            .map(|r| r.backend.name())
            .map_err(|e| to_py(py, e))
    }

    /// SGLang 0.5.23's `page_unified_layout` object of a page_unified pool; None for every
    /// other layout.
    #[getter]
    fn page_unified_layout(&self) -> Option<super::unified::PyPageUnifiedLayout> {
        super::unified::PyPageUnifiedLayout::of_spec(&self.spec)
    }

    /// The tensors the pool allocates, as element shapes (MHA: K and V in one; asymmetric MHA:
    /// one each); `HostPool(spec, allocations)` takes them in this order.
    #[getter]
    fn allocation_shapes(&self) -> Vec<Vec<u64>> {
        self.spec.allocations().0
    }

    /// Bytes a chunked CUDA host registration of allocation `allocation` must not split (0: any
    /// split is fine).
    fn registration_unit(&self, allocation: usize) -> PyResult<u64> {
        let count = self.spec.allocations().0.len();
        if allocation >= count {
            return Err(value_err(format!(
                "allocation {allocation} is out of range [0, {count})"
            )));
        }
        Ok(self.spec.registration_unit(allocation))
    }

    /// The dim of a plane's tensor whose entries are SGLang's per-layer views (1: a transposed
    /// page-major tensor), or None where the layout has none; `transpose_direct`: the release
    /// transposes MHA page_first_direct too.
    fn layer_view_dim(&self, transpose_direct: bool) -> Option<usize> {
        self.spec.layer_view_dim(transpose_direct)
    }

    /// Whether a V4 pool's rows are the C4 page row its token-granular path addresses.
    #[getter]
    fn token_rows(&self) -> bool {
        self.spec.token_rows()
    }

    /// Whether the layout lays pages a fixed stride apart (the only layouts SGLang's
    /// `is_stride_page_aligned` looks at; every other answers False unread).
    #[getter]
    fn page_strided(&self) -> bool {
        self.spec.page_strides().is_some()
    }

    /// The shape SGLang's `get_dummy_flat_data_page` fills, or None where it has none.
    #[getter]
    fn dummy_page_shape(&self) -> Option<Vec<u64>> {
        self.spec.dummy_page_shape()
    }

    /// The shape of the write-back staging buffer SGLang allocates for this pool (V4
    /// page_first), or None.
    #[getter]
    fn staging_shape(&self) -> Option<Vec<u64>> {
        self.spec.staging_shape()
    }

    /// Host layer `layer_id` of this pool, or a `LayerIndexError` naming the pool (an int no
    /// layer number reaches included).
    pub(super) fn layer(&self, py: Python<'_>, layer_id: &Bound<'_, PyAny>) -> PyResult<u64> {
        let layers = self.spec.layers;
        if !layer_id.is_instance_of::<pyo3::types::PyInt>() {
            layer_id.extract::<i64>()?; // the TypeError of a non-int
        }
        match layer_id.extract::<i64>() {
            Ok(l) if (0..layers as i64).contains(&l) => Ok(l as u64),
            _ => {
                let shown = layer_id.str()?.to_string();
                let name = &self.spec.name;
                let text = format!("{name} layer_id {shown} out of range [0, {layers})");
                Err(to_py(py, crate::Error::layer_index(text.trim_start())))
            }
        }
    }

    /// The page `index` names (`get_data_page`), as (offset, shape, strides) in elements from
    /// the start of the pool's first allocation; a page outside the pool is a `PageIndexError`
    /// (an int no slot number reaches included).
    fn page_view(
        &self,
        py: Python<'_>,
        index: &Bound<'_, PyAny>,
    ) -> PyResult<(u64, Vec<u64>, Vec<u64>)> {
        // SGLang refuses the layout before it reads the index, except under DCP, where its MLA
        // pool first checks the index as a logical page start inside the pool
        // (`data_page_start`).
        if self.spec.dcp_size == 1 {
            self.spec.refuse_unified().map_err(|e| to_py(py, e))?;
        }
        let int = py_int(index, "index")?;
        let index = int.extract::<i64>().map_err(|_| {
            let slots = match self.spec.kind {
                PoolKind::V4Paged => self.spec.rows.saturating_mul(self.spec.page_size),
                _ => self.spec.rows,
            };
            let shown = index.str().map(|s| s.to_string()).unwrap_or_default();
            to_py(
                py,
                crate::Error::page_index(format!(
                    "page index {shown} is out of range: the host pool has {slots} slots"
                )),
            )
        })?;
        let start = self.spec.data_page_start(index).map_err(|e| to_py(py, e))?;
        let v = self.spec.page_view(start).map_err(|e| to_py(py, e))?;
        Ok((v.offset, u64s(&v.shape), u64s(&v.strides)))
    }
}

impl PyPoolSpec {
    fn check_plane(&self, plane: usize) -> PyResult<()> {
        if plane >= self.spec.planes().len() {
            return Err(value_err(format!(
                "plane {plane} is out of range [0, {})",
                self.spec.planes().len()
            )));
        }
        Ok(())
    }
}
