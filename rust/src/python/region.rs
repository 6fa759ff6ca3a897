//! `_core.HostRegion`: a Rust-owned host allocation exported to Python as a writable buffer.

use std::ffi::c_int;
use std::ptr::NonNull;

use pyo3::ffi;
use pyo3::prelude::*;

use super::args::{int_in, str_or};
use super::errors::{to_py, type_err};
use super::memory::StorageWatch;
use crate::host_mem::{self, HugePage, HugePageMode, RegionOptions};

#[pyclass(frozen, module = "hostkv_rs._core", name = "HostRegion")]
pub struct PyHostRegion {
    pub(crate) inner: host_mem::HostRegion,
    /// What keeps adopted memory allocated (a CPU tensor's storage); None for memory mapped
    /// here.
    owner: Option<Py<PyAny>>,
    /// Adopted memory's torch storage, checked before the bytes are handed out or pinned.
    pub(crate) watch: Option<StorageWatch>,
}

#[pymethods]
impl PyHostRegion {
    #[new]
    /// `hugepage`/`hugepage_mode` None: the defaults ("": base pages; "prefer").
    #[pyo3(signature = (nbytes, *, hugepage = None, hugepage_mode = None, numa_node = None, pretouch_threads = None))]
    fn new(
        py: Python<'_>,
        nbytes: &Bound<'_, PyAny>,
        hugepage: Option<&Bound<'_, PyAny>>,
        hugepage_mode: Option<&Bound<'_, PyAny>>,
        numa_node: Option<&Bound<'_, PyAny>>,
        pretouch_threads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let nbytes = int_in(nbytes, "nbytes", 0, i64::MAX as u128, "[0, 2**63)")? as usize;
        let hugepage = str_or(hugepage, "hugepage", "", "'' for base pages, '2MB', '1GB'")?;
        let hugepage_mode = str_or(
            hugepage_mode,
            "hugepage_mode",
            "prefer",
            "'prefer' or 'required'",
        )?;
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
            hugepage: HugePage::parse(&hugepage).map_err(|e| to_py(py, e))?,
            mode: HugePageMode::parse(&hugepage_mode).map_err(|e| to_py(py, e))?,
            numa_node,
            pretouch_threads,
        };
        // Pre-faulting a large region takes seconds; let other Python threads run.
        let region = py
            .detach(|| host_mem::HostRegion::new(nbytes, opts))
            .map_err(|e| to_py(py, e))?;
        Ok(Self {
            inner: region,
            owner: None,
            watch: None,
        })
    }

    /// A region over a contiguous CPU tensor's memory (a storage backend's allocation), which
    /// it keeps alive: registered with CUDA by `register_cuda` like any region, so transfers
    /// find the registration and `unregister_cuda` waits for them; it frees nothing.
    #[staticmethod]
    fn adopt(tensor: &Bound<'_, PyAny>) -> PyResult<Self> {
        if tensor.cast::<PyHostRegion>().is_ok() {
            return Err(type_err(
                "HostRegion.adopt takes a CPU tensor, not a HostRegion",
            ));
        }
        if tensor.cast::<pyo3::types::PyTuple>().is_ok() {
            return Err(type_err(
                "HostRegion.adopt takes a CPU tensor (its view of the storage is the region), \
                 not an (owner, byte_offset) pair",
            ));
        }
        let mem = super::memory::host_memory(tensor, "adopted memory")?;
        let nbytes: u64 = tensor.getattr("nbytes")?.extract()?;
        // SAFETY: `host_memory` checked a contiguous CPU tensor whose `nbytes` lie inside its
        // storage (`mem.len` runs to the storage's end), and holds that storage (`mem.owner`),
        // which this region keeps (for good if its unregistration times out, see Drop).
        let inner = unsafe { host_mem::HostRegion::adopt(mem.addr, nbytes.min(mem.len) as usize) };
        Ok(Self {
            inner,
            owner: Some(mem.owner),
            watch: mem.watch,
        })
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    /// Refused, like every other hand-out of the memory, once adopted memory's storage no
    /// longer holds it.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<u64> {
        self.check(py)?;
        Ok(self.inner.addr())
    }

    #[getter]
    fn hugepage_tier(&self) -> &'static str {
        self.inner.tier().name()
    }

    #[getter]
    fn numa_node(&self) -> Option<u32> {
        self.inner.numa_node()
    }

    // The range lock is held for a whole registration, which runs without the GIL: these wait
    // for it without the GIL too, so another thread's registration never stalls the rest.
    #[getter]
    fn pinned(&self, py: Python<'_>) -> bool {
        let region = &self.inner;
        py.detach(|| region.pinned())
    }

    #[getter]
    fn registered_ranges(&self, py: Python<'_>) -> Vec<(u64, usize)> {
        let region = &self.inner;
        py.detach(|| region.registered_ranges())
    }

    /// Pins the region for `device` (a CUDA ordinal: the pool's GPU; None: this thread's current
    /// context, else GPU 0).
    /// `granularity` (bytes a chunk must not split) and `chunk_limit` (the most bytes one
    /// registration call takes) are read by name, as every other argument, so a negative or
    /// huge value is a ValueError naming it, not an OverflowError.
    #[pyo3(signature = (granularity = None, chunk_limit = None, device = None))]
    fn register_cuda(
        &self,
        py: Python<'_>,
        granularity: Option<&Bound<'_, PyAny>>,
        chunk_limit: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let bytes = |value: Option<&Bound<'_, PyAny>>, name: &str, default: usize| {
            value
                .map(|v| int_in(v, name, 0, usize::MAX as u128, "[0, 2**64)").map(|n| n as usize))
                .unwrap_or(Ok(default))
        };
        self.check(py)?;
        let granularity = bytes(granularity, "granularity", 0)?;
        let chunk_limit = bytes(chunk_limit, "chunk_limit", 256 << 30)?;
        let device = device
            .map(|d| int_in(d, "device", 0, i32::MAX as u128, "[0, 2**31)"))
            .transpose()?
            .map(|d| d as i32);
        let region = &self.inner;
        py.detach(|| region.register_cuda(granularity, chunk_limit, device))
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

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "HostRegion(nbytes={}, address={:#x}, hugepage_tier={:?}, pinned={})",
            self.inner.len(),
            self.inner.addr(),
            self.inner.tier().name(),
            if self.pinned(py) { "True" } else { "False" }
        )
    }

    /// Writable 1-D unsigned-byte buffer over the whole region; the exporter (this object) stays
    /// alive as long as any view does, because the view holds a reference to it.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        slf.get().check(slf.py())?;
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

impl PyHostRegion {
    /// Refuses adopted memory whose storage no longer holds it.
    pub(crate) fn check(&self, py: Python<'_>) -> PyResult<()> {
        match &self.watch {
            Some(watch) => watch.check(py, || "HostRegion (adopted memory)".to_owned()),
            None => Ok(()),
        }
    }
}

impl Drop for PyHostRegion {
    /// Garbage collection of a pinned region: unpinning waits for the transfers queued on it,
    /// so do it with the GIL released (the inner region's own drop then only unmaps). Reading
    /// `pinned` here with the GIL held cannot wait: no other thread can be registering a region
    /// that is being dropped.
    fn drop(&mut self) {
        if self.inner.pinned() {
            let region = &self.inner;
            // SAFETY: a pyclass is dropped by its tp_dealloc, with the GIL held.
            let py = unsafe { Python::assume_attached() };
            // An error was logged; the inner drop then leaves the memory mapped (see HostRegion).
            if py.detach(|| region.unregister_cuda()).is_err() {
                // The GPU may still write into the memory: it stays mapped (adopted memory: its
                // owner stays alive) for good, and the inner drop does not wait a second time
                // with the GIL held.
                self.inner.leak();
                if let Some(owner) = self.owner.take() {
                    std::mem::forget(owner);
                }
            }
        }
    }
}
