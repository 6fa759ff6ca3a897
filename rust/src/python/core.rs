//! `_core.PoolCore`: one host pool's planes and the transfers between them and device layers.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

#[cfg(feature = "raw-calls")]
use super::args;
use super::errors::{to_py, transfer_err};
use super::memory::host_memory;
#[cfg(feature = "raw-calls")]
use super::raw::IndexArg;
use crate::engine::{CopyEngine, Unlock};
use crate::layout::PlaneLayout;
use crate::request::{Backend, DeviceSide, HostGeometry, IndexArray, Layout, Op, TransferRequest};

/// Lets the engines run long work without the GIL.
pub(crate) struct Gil<'py>(pub(crate) Python<'py>);

impl Unlock for Gil<'_> {
    fn unlocked(&self, work: &mut (dyn FnMut() -> crate::Result<()> + Send)) -> crate::Result<()> {
        self.0.detach(work)
    }
}

/// Geometry and transfers of one host pool (1 or 2 planes).
#[pyclass(frozen, module = "hostkv_rs._core", name = "PoolCore")]
pub struct PyPoolCore {
    pub(crate) geom: HostGeometry,
    planes: Vec<PlaneLayout>,
    /// What keeps each plane's memory alive (see `memory`); never read, only held.
    _owners: Vec<Py<PyAny>>,
}

impl PyPoolCore {
    /// Runs one transfer on `engine` (queued on `stream` for a CUDA engine); every argument is
    /// checked (by the planner or the kernel path's validation) before a byte moves.
    ///
    /// # Safety
    /// `device_ptrs` are the bases of live device layers (plane-major) of `rows` rows of each
    /// plane's item size, in the memory `engine` names; the index arrays are contiguous arrays of
    /// the stated width, length and residency. The caller keeps all of them alive and unwritten
    /// for the call (CUDA: until the work queued on `stream` has run, which the caching
    /// allocator's stream order guarantees for tensors freed after the call).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run(
        &self,
        py: Python<'_>,
        backend: Backend,
        op: Op,
        device_ptrs: Vec<u64>,
        rows: usize,
        host_idx: IndexArray,
        dev_idx: IndexArray,
        engine: &dyn CopyEngine,
        stream: u64,
    ) -> PyResult<()> {
        let device_side = DeviceSide {
            layer_ptrs: device_ptrs,
            rows,
            memory: engine.memory(),
        };
        // SAFETY: the plane addresses are this core's own memory, held alive by `_owners`; the
        // device side and the index arrays are what this function's caller guarantees.
        let req = unsafe {
            TransferRequest::new(
                self.geom.clone(),
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
impl PyPoolCore {
    #[new]
    #[pyo3(signature = (layout, num_layers, rows, page_size, item_bytes, planes, head_num = 1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
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
            return Err(PyValueError::new_err(format!(
                "a host pool has 1 or 2 planes: got {} item sizes and {} planes",
                item_bytes.len(),
                planes.len()
            )));
        }
        if item_bytes.contains(&0) {
            return Err(PyValueError::new_err(format!(
                "item_bytes must be positive (bytes of one row of one layer), got {item_bytes:?}"
            )));
        }
        let mut layouts = Vec::with_capacity(item_bytes.len());
        let mut plane_addrs = Vec::with_capacity(item_bytes.len());
        let mut owners = Vec::with_capacity(item_bytes.len());
        // page_unified's planes (MHA's K and V) are components of one allocation: the same
        // memory is passed for each.
        let n = item_bytes.len();
        for (p, (&item, plane)) in item_bytes.iter().zip(&planes).enumerate() {
            let pl = PlaneLayout::plane(layout, num_layers, rows, page_size, item, head_num, p, n)
                .map_err(|e| to_py(py, e))?;
            let mem = host_memory(plane, &format!("plane {p}"))?;
            if mem.len < pl.nbytes || (mem.addr == 0 && pl.nbytes > 0) {
                return Err(PyValueError::new_err(format!(
                    "plane {p} memory of {} bytes at {:#x} cannot hold {} bytes",
                    mem.len, mem.addr, pl.nbytes
                )));
            }
            layouts.push(pl);
            plane_addrs.push(mem.addr);
            owners.push(mem.owner);
        }
        let heads = if matches!(layout, Layout::PageHead | Layout::PageUnified) {
            head_num
        } else {
            1
        };
        let geom = HostGeometry {
            layout,
            layers: num_layers,
            rows,
            page_size,
            heads,
            item_bytes,
            plane_base: plane_addrs,
        };
        Ok(Self {
            geom,
            planes: layouts,
            _owners: owners,
        })
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

    #[getter]
    fn plane_addrs(&self) -> Vec<u64> {
        self.geom.plane_base.clone()
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
