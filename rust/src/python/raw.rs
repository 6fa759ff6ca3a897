//! The raw entry points `HostPool.load/backup` (cargo feature `raw-calls`): device layers and
//! index arrays as integer addresses, for tests and benchmarks that drive the core directly. A
//! wrong address is a crash, so the release wheel leaves them out; pools go through
//! `DeviceBinding`, which takes tensors.

use pyo3::prelude::*;

use super::errors::{to_py, transfer_err, value_err};
use super::host_pool::PyHostPool;
use crate::config::CpuEngine;
use crate::engine::{self, CopyEngine};
use crate::request::{Backend, IndexArray, IndexMap, IndexWidth, Op};

impl PyHostPool {
    /// A host layer id from Python; a negative one is out of range like a too large one.
    pub(crate) fn host_layer_arg(&self, py: Python<'_>, host_layer: i64) -> PyResult<usize> {
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

    /// The raw entry points' (device, engine) strings.
    fn engine_arg(device: &str, engine: &str) -> PyResult<&'static dyn CopyEngine> {
        match (device, engine) {
            ("cpu", "plan") => Ok(engine::for_cpu(CpuEngine::Plan)),
            ("cpu", "emulated") => Ok(engine::for_cpu(CpuEngine::Emulated)),
            ("cpu", other) => Err(value_err(format!(
                "Unsupported engine: {other}; expected 'plan' or 'emulated'"
            ))),
            ("cuda", _) => Ok(engine::for_cuda()),
            (other, _) => Err(value_err(format!(
                "Unsupported device: {other}; expected 'cpu' or 'cuda'"
            ))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn transfer(
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
        map: IndexMap,
    ) -> PyResult<()> {
        let backend = Backend::parse(backend).map_err(|e| to_py(py, e))?;
        let rows = usize::try_from(device_rows).map_err(|_| {
            transfer_err(
                py,
                format!("device_rows must be non-negative, got {device_rows}"),
            )
        })?;
        let engine = Self::engine_arg(device, engine)?;
        let host_idx = index_array(py, "host", host_idx, map)?;
        let dev_idx = index_array(py, "device", dev_idx, map)?;
        self.check_memory(py)?;
        // SAFETY: the raw entry points are the private interface of tests and benchmarks, whose
        // promise is `run_checked`'s: `device_ptrs` are live device layers of `device_rows` rows
        // on `device`, the index arrays contiguous arrays of the stated length and residency,
        // all held by the caller for this call (CUDA: freed only in `stream`'s order); the plane
        // memory was just checked, and nothing since runs Python.
        unsafe {
            self.run_checked(
                py,
                backend,
                op,
                device_ptrs,
                rows,
                None,
                host_idx,
                dev_idx,
                engine,
                stream,
                None,
            )
        }
    }
}

/// An index array as the raw entry points take it: (address, length, itemsize, on_device).
pub(crate) type IndexArg = (u64, i64, i64, bool);

fn index_array(
    py: Python<'_>,
    which: &str,
    (ptr, len, itemsize, on_device): IndexArg,
    map: IndexMap,
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
        map,
    })
}
