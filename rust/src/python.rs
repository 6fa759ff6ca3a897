//! PyO3 bindings: module `hostkv_rs._core` (see docs/design.md for the interface).
//!
//! Errors map to Python exceptions in one place (`to_py`). Nothing here panics: every fallible
//! step returns a `PyResult`.

use std::ffi::c_int;
use std::ptr::NonNull;

use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::Error;
use crate::host_mem::{self, HugePage, HugePageMode, RegionOptions};
use crate::layout::PlaneLayout;
use crate::pool::{PoolKind, PoolSpec};
use crate::transfer::{
    Backend, DeviceSide, HostGeometry, IndexArray, IndexWidth, Layout, Op, TransferRequest,
};
use crate::{cpu, cuda, plan};

/// Plans that move more than this release the GIL while copying; smaller ones are cheaper to run
/// than the ~1 us a detach/reattach costs.
const DETACH_BYTES: u64 = 1 << 20;

static TRANSFER_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `TransferError(ValueError, RuntimeError)`: SGLang's kernels raise RuntimeError for bad
/// transfer arguments and its pools raise ValueError, so callers may catch either.
fn transfer_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = TRANSFER_ERROR.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let ns = PyDict::new(py);
        ns.set_item("__module__", "hostkv_rs._core")?;
        ns.set_item(
            "__doc__",
            "Bad transfer arguments (indices, lengths, layer ids); nothing was written.",
        )?;
        let bases = PyTuple::new(
            py,
            [
                py.get_type::<PyValueError>(),
                py.get_type::<PyRuntimeError>(),
            ],
        )?;
        let ty = py
            .import("builtins")?
            .getattr("type")?
            .call1(("TransferError", bases, ns))?;
        Ok(ty.cast_into::<PyType>()?.unbind())
    })?;
    Ok(ty.bind(py))
}

static PAGE_INDEX_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `PageIndexError(ValueError, IndexError)`: an L3 page outside the pool, which SGLang's
/// `kv_buffer[row]` reports as an IndexError.
fn page_index_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = PAGE_INDEX_ERROR.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let ns = PyDict::new(py);
        ns.set_item("__module__", "hostkv_rs._core")?;
        ns.set_item(
            "__doc__",
            "A page outside the host pool; nothing was read or written.",
        )?;
        let bases = PyTuple::new(
            py,
            [
                py.get_type::<PyValueError>(),
                py.get_type::<pyo3::exceptions::PyIndexError>(),
            ],
        )?;
        let ty = py
            .import("builtins")?
            .getattr("type")?
            .call1(("PageIndexError", bases, ns))?;
        Ok(ty.cast_into::<PyType>()?.unbind())
    })?;
    Ok(ty.bind(py))
}

fn to_py(py: Python<'_>, e: Error) -> PyErr {
    match e {
        Error::Unsupported(m) | Error::Geometry(m) | Error::Value(m) => PyValueError::new_err(m),
        Error::PageIndex(m) => match page_index_error_type(py) {
            Ok(ty) => PyErr::from_type(ty.clone(), m),
            Err(init_failed) => init_failed,
        },
        Error::Assertion(m) => pyo3::exceptions::PyAssertionError::new_err(m),
        Error::NotImplemented(m) => pyo3::exceptions::PyNotImplementedError::new_err(m),
        Error::InvalidTransfer(m) => match transfer_error_type(py) {
            Ok(ty) => PyErr::from_type(ty.clone(), m),
            Err(init_failed) => init_failed,
        },
        Error::HostMemory(m) => PyMemoryError::new_err(m),
        Error::CudaUnavailable(m) | Error::Cuda(m) => PyRuntimeError::new_err(m),
        // Internal to `cuda::try_execute` (retried detached below); never expected here.
        e @ Error::WouldBlock => PyRuntimeError::new_err(e.to_string()),
    }
}

fn transfer_err(py: Python<'_>, msg: String) -> PyErr {
    to_py(py, Error::InvalidTransfer(msg))
}

/// An integer argument in `[lo, hi]`: TypeError for a non-integer (a bool included), ValueError
/// naming the parameter, the value and the range otherwise (never a bare OverflowError).
fn int_in(value: &Bound<'_, PyAny>, name: &str, lo: u128, hi: u128, range: &str) -> PyResult<u128> {
    let is_bool = value.is_instance_of::<pyo3::types::PyBool>();
    let as_int = if is_bool {
        None
    } else {
        value.call_method0("__index__").ok()
    };
    let Some(int) = as_int else {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{name} must be an integer, got {}",
            value.repr()?
        )));
    };
    match int.extract::<i128>() {
        Ok(v) if v >= lo as i128 && (v as u128) <= hi => Ok(v as u128),
        _ => Err(PyValueError::new_err(format!(
            "{name} must lie in {range}, got {}",
            int.repr()?
        ))),
    }
}

#[pyclass(frozen, module = "hostkv_rs._core", name = "HostRegion")]
pub struct PyHostRegion {
    inner: host_mem::HostRegion,
}

#[pymethods]
impl PyHostRegion {
    #[new]
    #[pyo3(signature = (nbytes, *, hugepage = "", hugepage_mode = "prefer", numa_node = None, pretouch_threads = None))]
    fn new(
        py: Python<'_>,
        nbytes: &Bound<'_, PyAny>,
        hugepage: &str,
        hugepage_mode: &str,
        numa_node: Option<&Bound<'_, PyAny>>,
        pretouch_threads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let nbytes = int_in(nbytes, "nbytes", 0, i64::MAX as u128, "[0, 2**63)")? as usize;
        let numa_node = numa_node
            .map(|n| int_in(n, "numa_node", 0, u32::MAX as u128, "[0, 2**32)"))
            .transpose()?
            .map(|n| n as u32);
        let pretouch_threads = match pretouch_threads {
            None => 0,
            Some(v) => int_in(
                v,
                "pretouch_threads",
                0,
                4096,
                "[0, 4096] (0 picks one per 4 MiB, up to the CPU count)",
            )? as usize,
        };
        let opts = RegionOptions {
            hugepage: HugePage::parse(hugepage).map_err(|e| to_py(py, e))?,
            mode: HugePageMode::parse(hugepage_mode).map_err(|e| to_py(py, e))?,
            numa_node,
            pretouch_threads,
        };
        // Pre-faulting a large region takes seconds; let other Python threads run.
        let region = py
            .detach(|| host_mem::HostRegion::new(nbytes, opts))
            .map_err(|e| to_py(py, e))?;
        Ok(Self { inner: region })
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn address(&self) -> u64 {
        self.inner.addr()
    }

    #[getter]
    fn hugepage_tier(&self) -> &'static str {
        self.inner.tier().name()
    }

    #[getter]
    fn numa_node(&self) -> Option<u32> {
        self.inner.numa_node()
    }

    #[getter]
    fn pinned(&self) -> bool {
        self.inner.pinned()
    }

    #[getter]
    fn registered_ranges(&self) -> Vec<(u64, usize)> {
        self.inner.registered_ranges()
    }

    #[pyo3(signature = (granularity = 0, chunk_limit = 256 << 30))]
    fn register_cuda(
        &self,
        py: Python<'_>,
        granularity: usize,
        chunk_limit: usize,
    ) -> PyResult<()> {
        let region = &self.inner;
        py.detach(|| region.register_cuda(granularity, chunk_limit))
            .map_err(|e| to_py(py, e))
    }

    /// Waits (bounded, without the GIL) for transfers queued on the region; raises RuntimeError
    /// when that wait runs out (the region then stays registered).
    fn unregister_cuda(&self, py: Python<'_>) -> PyResult<()> {
        let region = &self.inner;
        py.detach(|| region.unregister_cuda())
            .map_err(|e| to_py(py, e))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "HostRegion(nbytes={}, address={:#x}, hugepage_tier={:?}, pinned={})",
            self.inner.len(),
            self.inner.addr(),
            self.inner.tier().name(),
            if self.inner.pinned() { "True" } else { "False" }
        )
    }

    /// Writable 1-D unsigned-byte buffer over the whole region; the exporter (this object) stays
    /// alive as long as any view does, because the view holds a reference to it.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let region = &slf.get().inner;
        // A zero-length buffer still needs a non-null pointer for some consumers.
        let buf = if region.is_empty() {
            NonNull::<u8>::dangling().as_ptr()
        } else {
            region.as_ptr()
        };
        // SAFETY: `view` comes from the interpreter; `buf..buf+len` is our live mapping, which
        // outlives the view because the view owns a reference to `slf`.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                buf as *mut std::ffi::c_void,
                region.len() as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        // PyBuffer_FillInfo allocates nothing, and PyBuffer_Release drops the owner reference.
    }
}

impl Drop for PyHostRegion {
    /// Garbage collection of a pinned region: unpinning waits for the transfers queued on it,
    /// so do it with the GIL released (the inner region's own drop then only unmaps).
    fn drop(&mut self) {
        if self.inner.pinned() {
            let region = &self.inner;
            // SAFETY: a pyclass is dropped by its tp_dealloc, with the GIL held.
            let py = unsafe { Python::assume_attached() };
            // An error was logged; the inner drop then leaves the memory mapped (see HostRegion).
            let _ = py.detach(|| region.unregister_cuda());
        }
    }
}

/// Geometry and transfers of one host pool (1 or 2 planes).
#[pyclass(frozen, module = "hostkv_rs._core", name = "PoolCore")]
pub struct PyPoolCore {
    geom: HostGeometry,
    planes: Vec<PlaneLayout>,
}

type IndexArg = (u64, i64, i64, bool);

fn index_array(
    py: Python<'_>,
    which: &str,
    (ptr, len, itemsize, on_device): IndexArg,
) -> PyResult<IndexArray> {
    let width = match itemsize {
        4 => IndexWidth::I32,
        8 => IndexWidth::I64,
        other => {
            return Err(transfer_err(
                py,
                format!("{which} indices must be int32 or int64, got an itemsize of {other} bytes"),
            ))
        }
    };
    let len = usize::try_from(len).map_err(|_| {
        transfer_err(
            py,
            format!("{which} index length must be non-negative, got {len}"),
        )
    })?;
    Ok(IndexArray {
        ptr,
        len,
        width,
        on_device,
    })
}

impl PyPoolCore {
    /// A host layer id from Python; a negative one is out of range like a too large one.
    fn host_layer_arg(&self, py: Python<'_>, host_layer: i64) -> PyResult<usize> {
        usize::try_from(host_layer).map_err(|_| {
            transfer_err(
                py,
                format!(
                    "host layer {host_layer} is out of range [0, {})",
                    self.geom.layers
                ),
            )
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        py: Python<'_>,
        backend: &str,
        op: Op,
        device_ptrs: Vec<u64>,
        device_rows: i64,
        host_idx: IndexArg,
        dev_idx: IndexArg,
        device: &str,
        stream: u64,
        engine: &str,
    ) -> PyResult<()> {
        let backend = Backend::parse(backend).map_err(|e| to_py(py, e))?;
        let rows = usize::try_from(device_rows).map_err(|_| {
            transfer_err(
                py,
                format!("device_rows must be non-negative, got {device_rows}"),
            )
        })?;
        // `device` other than "cpu" / "cuda" is refused below, before the request is used.
        let memory = if device == "cuda" {
            crate::transfer::DeviceMemory::Cuda
        } else {
            crate::transfer::DeviceMemory::Host
        };
        let device_side = DeviceSide {
            layer_ptrs: device_ptrs,
            rows,
            memory,
        };
        let host_idx = index_array(py, "host", host_idx)?;
        let dev_idx = index_array(py, "device", dev_idx)?;
        // SAFETY: `_core` is the package's private binding, and this is the promise its Python
        // callers (the hostkv_rs pools) make for every transfer: the plane addresses given to
        // `PoolCore(...)` are the pool's own host buffers, which the pool object keeps alive (and
        // never frees while a transfer runs); `device_ptrs` are the data pointers of the device
        // layer tensors (plane-major, each checked by the pool to hold `device_rows` rows of the
        // plane's item size) on `device`, and the index arrays are contiguous int32/int64
        // tensors of the stated length and residency. The caller holds all of them for this
        // call, and CUDA work is enqueued on `stream`, in whose order the caching allocator
        // reuses freed device memory. None of them is a Rust object of this call. A pool never
        // writes an index tensor while a transfer reads it.
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
        match (device, engine) {
            ("cpu", "plan") => {
                let plan = plan::build(&req).map_err(|e| to_py(py, e))?;
                let run = if plan.bytes() > DETACH_BYTES {
                    py.detach(|| cpu::execute(&plan))
                } else {
                    cpu::execute(&plan)
                };
                run.map_err(|e| to_py(py, e))
            }
            ("cpu", "emulated") => {
                plan::validate(&req).map_err(|e| to_py(py, e))?;
                py.detach(|| cuda::emulate(&req)).map_err(|e| to_py(py, e))
            }
            ("cpu", other) => Err(PyValueError::new_err(format!(
                "Unsupported engine: {other}; expected 'plan' or 'emulated'"
            ))),
            ("cuda", _) => {
                let c = plan::validate(&req).map_err(|e| to_py(py, e))?;
                let per_row: u64 = self.geom.item_bytes.iter().map(|&i| i as u64).sum();
                let bytes = (c.len as u64)
                    .saturating_mul(c.layer_count)
                    .saturating_mul(per_row);
                // Small transfers run with the GIL unless they would block (JIT, a staging
                // wait, allocation, an index read-back); then again without it.
                let run = if bytes > DETACH_BYTES {
                    py.detach(|| cuda::execute(&req, stream))
                } else {
                    match cuda::try_execute(&req, stream) {
                        Err(Error::WouldBlock) => py.detach(|| cuda::execute(&req, stream)),
                        other => other,
                    }
                };
                run.map_err(|e| to_py(py, e))
            }
            (other, _) => Err(PyValueError::new_err(format!(
                "Unsupported device: {other}; expected 'cpu' or 'cuda'"
            ))),
        }
    }
}

#[pymethods]
impl PyPoolCore {
    #[new]
    #[pyo3(signature = (layout, num_layers, rows, page_size, item_bytes, plane_addrs, head_num = 1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layout: &str,
        num_layers: usize,
        rows: usize,
        page_size: usize,
        item_bytes: Vec<usize>,
        plane_addrs: Vec<u64>,
        head_num: usize,
    ) -> PyResult<Self> {
        let layout = Layout::parse(layout).map_err(|e| to_py(py, e))?;
        if item_bytes.is_empty() || item_bytes.len() > 2 || item_bytes.len() != plane_addrs.len() {
            return Err(PyValueError::new_err(format!(
                "a host pool has 1 or 2 planes: got {} item sizes and {} plane addresses",
                item_bytes.len(),
                plane_addrs.len()
            )));
        }
        if item_bytes.contains(&0) {
            return Err(PyValueError::new_err(format!(
                "item_bytes must be positive (bytes of one row of one layer), got {item_bytes:?}"
            )));
        }
        let mut planes = Vec::with_capacity(item_bytes.len());
        for (p, (&item, &addr)) in item_bytes.iter().zip(&plane_addrs).enumerate() {
            let pl = PlaneLayout::new(layout, num_layers, rows, page_size, item, head_num)
                .map_err(|e| to_py(py, e))?;
            if (addr == 0 && pl.nbytes > 0) || addr.checked_add(pl.nbytes).is_none() {
                return Err(PyValueError::new_err(format!(
                    "plane {p} address {addr:#x} cannot hold {} bytes",
                    pl.nbytes
                )));
            }
            planes.push(pl);
        }
        let heads = if layout == Layout::PageHead {
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
        Ok(Self { geom, planes })
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

    /// Device layers -> host: every layer (`device_ptrs` holds `nplanes * L` layer bases), or only
    /// `host_layer` (`device_ptrs` holds `nplanes` bases) for a layer-sharded pool.
    #[pyo3(signature = (backend, device_ptrs, device_rows, host_idx, dev_idx, device, stream, engine = "plan", host_layer = None))]
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
    ) -> PyResult<()> {
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
        )
    }

    /// Host layer `host_layer` -> one device layer: `device_ptrs` holds `nplanes` layer bases.
    #[pyo3(signature = (backend, host_layer, device_ptrs, device_rows, host_idx, dev_idx, device, stream, engine = "plan"))]
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
    ) -> PyResult<()> {
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
        )
    }
}

/// The first call probes the driver (`cuInit` can take seconds): without the GIL.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    py.detach(cuda::available)
}

#[pyfunction]
fn runtime_info(py: Python<'_>) -> String {
    format!(
        "hostkv_rs {}; {}",
        env!("CARGO_PKG_VERSION"),
        py.detach(cuda::runtime_info)
    )
}

/// Raises TransferError if a kernel recorded a bad device-resident index since the last check.
#[pyfunction]
fn check_device_errors(py: Python<'_>) -> PyResult<()> {
    cuda::check_device_errors().map_err(|e| to_py(py, e))
}

/// A host pool's geometry in SGLang's terms, and everything derived from it (`pool::PoolSpec`):
/// buffer shapes, the (layout, io_backend) check with SGLang's texts, L3 page metadata and views.
#[pyclass(frozen, module = "hostkv_rs._core", name = "PoolSpec")]
pub struct PyPoolSpec {
    spec: PoolSpec,
}

fn u64s(v: &[u64]) -> Vec<u64> {
    v.to_vec()
}

#[pymethods]
impl PyPoolSpec {
    #[new]
    #[pyo3(signature = (kind, layout, num_layers, rows, page_size, dims, itemsize, head_num = None, dcp_size = None, dcp_rank = None, name = ""))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kind: &str,
        layout: &str,
        num_layers: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        dims: Vec<Bound<'_, PyAny>>,
        itemsize: &Bound<'_, PyAny>,
        head_num: Option<&Bound<'_, PyAny>>,
        dcp_size: Option<&Bound<'_, PyAny>>,
        dcp_rank: Option<&Bound<'_, PyAny>>,
        name: &str,
    ) -> PyResult<Self> {
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
        let kind = PoolKind::parse(kind).map_err(|e| to_py(py, e))?;
        let spec = PoolSpec::new(
            kind, layout, num_layers, rows, page_size, head_num, &dims, itemsize, dcp_size,
            dcp_rank, name,
        )
        .map_err(|e| to_py(py, e))?;
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

    /// SGLang's (layout, io_backend) check for this pool kind: "kernel" or "direct", or
    /// ValueError with SGLang's text (whatever `io_backend` is).
    fn check_pair(&self, py: Python<'_>, io_backend: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let text = io_backend.cast::<pyo3::types::PyString>().ok();
        let name = text.map(|t| t.to_cow()).transpose()?;
        let shown = io_backend.str()?.to_cow()?.into_owned();
        match self.spec.check_pair(name.as_deref(), &shown) {
            Ok(crate::transfer::Backend::Kernel) => Ok("kernel"),
            Ok(crate::transfer::Backend::Direct) => Ok("direct"),
            Err(e) => Err(to_py(py, e)),
        }
    }

    /// DeepSeek V4's token-granular (layout, io_backend) check, with SGLang's text.
    fn check_token_pair(&self, py: Python<'_>, io_backend: &Bound<'_, PyAny>) -> PyResult<()> {
        let text = io_backend.cast::<pyo3::types::PyString>().ok();
        let name = text.map(|t| t.to_cow()).transpose()?;
        let shown = io_backend.str()?.to_cow()?.into_owned();
        self.spec
            .check_token_pair(name.as_deref(), &shown)
            .map_err(|e| to_py(py, e))
    }

    /// `get_page_buffer_meta`: (pointers, sizes) for the pages `indices` lists (every page's
    /// first slot; logical slots under DCP), given each plane's host address.
    fn page_meta(
        &self,
        py: Python<'_>,
        bases: Vec<u64>,
        indices: Vec<i64>,
    ) -> PyResult<(Vec<u64>, Vec<u64>)> {
        self.check_bases(&bases)?;
        let starts = self.spec.page_starts(&indices).map_err(|e| to_py(py, e))?;
        Ok(self.spec.page_meta(&bases, &starts))
    }

    /// `get_split_heads_page_buffer_meta` (MHA page_head).
    fn split_heads_meta(
        &self,
        py: Python<'_>,
        bases: Vec<u64>,
        indices: Vec<i64>,
        split_factor: u64,
    ) -> PyResult<(Vec<u64>, Vec<u64>)> {
        self.check_bases(&bases)?;
        let starts = self.spec.page_starts(&indices).map_err(|e| to_py(py, e))?;
        self.spec
            .split_heads_meta(&bases, &starts, split_factor)
            .map_err(|e| to_py(py, e))
    }

    /// The page `index` names (`get_data_page`), as (offset, shape, strides) in elements from
    /// the start of the pool's first allocation.
    fn page_view(&self, py: Python<'_>, index: i64) -> PyResult<(u64, Vec<u64>, Vec<u64>)> {
        let start = self.spec.data_page_start(index).map_err(|e| to_py(py, e))?;
        let v = self.spec.page_view(start).map_err(|e| to_py(py, e))?;
        Ok((v.offset, u64s(&v.shape), u64s(&v.strides)))
    }

    /// `get_contiguous_buf_infos` (MLA, V4) for a pool whose bytes start at `base`.
    fn contiguous_buf_infos(
        &self,
        py: Python<'_>,
        base: u64,
    ) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
        self.check_bases(&[base])?;
        self.spec
            .contiguous_buf_infos(base)
            .map_err(|e| to_py(py, e))
    }
}

impl PyPoolSpec {
    fn check_plane(&self, plane: usize) -> PyResult<()> {
        if plane >= self.spec.planes().len() {
            return Err(PyValueError::new_err(format!(
                "plane {plane} is out of range [0, {})",
                self.spec.planes().len()
            )));
        }
        Ok(())
    }

    fn check_bases(&self, bases: &[u64]) -> PyResult<()> {
        if bases.len() != self.spec.planes().len() {
            return Err(PyValueError::new_err(format!(
                "expected {} plane addresses, got {}",
                self.spec.planes().len(),
                bases.len()
            )));
        }
        for (p, (&base, plane)) in bases.iter().zip(self.spec.planes()).enumerate() {
            if base.checked_add(plane.nbytes).is_none() {
                return Err(PyValueError::new_err(format!(
                    "plane {p} address {base:#x} cannot hold {} bytes",
                    plane.nbytes
                )));
            }
        }
        Ok(())
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyHostRegion>()?;
    m.add_class::<PyPoolCore>()?;
    m.add_class::<PyPoolSpec>()?;
    m.add("PageIndexError", page_index_error_type(py)?)?;
    m.add("C4_PAGE_TOKENS", crate::pool::c4::PAGE_TOKENS)?;
    m.add("C4_VALUE_BYTES", crate::pool::c4::VALUE_BYTES)?;
    m.add("C4_SCALE_BYTES", crate::pool::c4::SCALE_BYTES)?;
    m.add("C4_ROW_BYTES", crate::pool::c4::ROW_BYTES)?;
    m.add("TransferError", transfer_error_type(py)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(runtime_info, m)?)?;
    m.add_function(wrap_pyfunction!(check_device_errors, m)?)?;
    Ok(())
}
