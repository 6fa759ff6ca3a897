//! `_core.PageUnifiedLayout`: SGLang 0.5.23's `PageUnifiedLayout` (`pool_host/page_unified.py`),
//! the page_unified pools' `page_unified_layout` attribute. Its checks and sizes are the core's
//! (`pool::unified`), so the pool and its layout object cannot disagree.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::errors::to_py;
use crate::pool::unified::{self, Unified};

/// Frozen, keyword-only and compared by value, like SGLang's msgspec struct.
#[pyclass(
    frozen,
    eq,
    hash,
    skip_from_py_object,
    module = "hostkv_rs._core",
    name = "PageUnifiedLayout"
)]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PyPageUnifiedLayout {
    #[pyo3(get)]
    page_size: i64,
    #[pyo3(get)]
    layer_num: i64,
    #[pyo3(get)]
    head_num: i64,
    #[pyo3(get)]
    head_group_num: i64,
    #[pyo3(get)]
    head_dim: i64,
    #[pyo3(get)]
    itemsize: i64,
    #[pyo3(get)]
    is_mla: bool,
}

impl PyPageUnifiedLayout {
    /// The layout object of a page_unified pool, from its spec (None for other layouts): MHA's
    /// K/V heads in `head_groups` groups, MLA's latent as one group of one head.
    pub(crate) fn of_spec(spec: &crate::pool::PoolSpec) -> Option<Self> {
        if spec.layout != crate::request::Layout::PageUnified {
            return None;
        }
        let is_mla = spec.kind == crate::pool::PoolKind::Mla;
        Some(Self {
            page_size: spec.page_size as i64,
            layer_num: spec.layers as i64,
            head_num: spec.heads as i64,
            head_group_num: spec.head_groups as i64,
            head_dim: *spec.dims.first()? as i64,
            itemsize: spec.itemsize as i64,
            is_mla,
        })
    }

    fn sizes(&self) -> Unified {
        let c: i64 = if self.is_mla { 1 } else { 2 };
        Unified {
            components: c as u64,
            page_size: self.page_size as u64,
            layers: self.layer_num as u64,
            head_groups: self.head_group_num as u64,
            group_bytes: self.group_bytes() as u64,
        }
    }
}

#[pymethods]
impl PyPageUnifiedLayout {
    #[new]
    #[pyo3(signature = (*, page_size, layer_num, head_num, head_group_num, head_dim, itemsize, is_mla = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        page_size: i64,
        layer_num: i64,
        head_num: i64,
        head_group_num: i64,
        head_dim: i64,
        itemsize: i64,
        is_mla: bool,
    ) -> PyResult<Self> {
        let fields = [
            page_size,
            layer_num,
            head_num,
            head_group_num,
            head_dim,
            itemsize,
        ];
        unified::check(fields, is_mla).map_err(|e| to_py(py, e))?;
        Ok(Self {
            page_size,
            layer_num,
            head_num,
            head_group_num,
            head_dim,
            itemsize,
            is_mla,
        })
    }

    /// 1 for MLA (the latent), 2 for MHA (K and V).
    #[getter]
    fn components(&self) -> i64 {
        if self.is_mla {
            1
        } else {
            2
        }
    }

    #[getter]
    fn heads_per_group(&self) -> i64 {
        self.head_num / self.head_group_num
    }

    /// One head group's row for one token: the copy unit.
    #[getter]
    fn group_bytes(&self) -> i64 {
        self.heads_per_group() * self.head_dim * self.itemsize
    }

    /// One (head group, layer) cell: every component of every token of the page.
    #[getter]
    fn layer_bytes(&self) -> u64 {
        self.sizes().layer_bytes()
    }

    #[getter]
    fn head_group_bytes(&self) -> u64 {
        self.sizes().head_group_bytes()
    }

    #[getter]
    fn bytes_per_page(&self) -> u64 {
        self.sizes().bytes_per_page()
    }

    /// The buffer's shape for `page_num` pages; its C order is the byte order.
    fn page_dims<'py>(&self, py: Python<'py>, page_num: i64) -> PyResult<Bound<'py, PyTuple>> {
        let dims: Vec<i64> = if self.is_mla {
            vec![page_num, self.layer_num, self.page_size, self.head_dim]
        } else {
            vec![
                page_num,
                self.head_group_num,
                self.layer_num,
                2,
                self.page_size,
                self.heads_per_group(),
                self.head_dim,
            ]
        };
        PyTuple::new(py, dims)
    }

    /// The byte span `(offset, length)`, inside one page, of the L3 chunk holding pool-local
    /// layers `layer_range = (start, end)` of head group `head_group`.
    #[pyo3(signature = (layer_range, head_group = 0))]
    fn chunk_span(
        &self,
        py: Python<'_>,
        layer_range: (i64, i64),
        head_group: i64,
    ) -> PyResult<(u64, u64)> {
        self.sizes()
            .chunk_span(layer_range.0, layer_range.1, head_group)
            .map_err(|e| to_py(py, e))
    }

    fn __repr__(&self) -> String {
        format!(
            "PageUnifiedLayout(page_size={}, layer_num={}, head_num={}, head_group_num={}, \
             head_dim={}, itemsize={}, is_mla={})",
            self.page_size,
            self.layer_num,
            self.head_num,
            self.head_group_num,
            self.head_dim,
            self.itemsize,
            if self.is_mla { "True" } else { "False" }
        )
    }
}
