//! PyO3 bindings: module `hostkv_rs._core` (see docs/design.md for the interface).
//!
//! Errors become Python exceptions in one place (`errors::to_py`). Nothing here panics: every
//! fallible step returns a `PyResult`.

mod args;
mod binding;
mod errors;
mod extent;
mod host_pool;
mod indices;
mod layer_map;
mod memory;
mod page_watch;
#[cfg(feature = "raw-calls")]
mod raw;
mod region;
mod spec;
mod tensor_calls;
mod unified;
mod v4;

use pyo3::prelude::*;

use crate::cuda;
use errors::{to_py, value_err};

/// The first call probes the driver (`cuInit` can take seconds): without the GIL.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    py.detach(cuda::available)
}

/// The (layout, io_backend) pairs a pool kind ("mha", "mha_asymmetric", "mla", "v4_paged")
/// serves.
#[pyfunction]
fn supported_pairs(py: Python<'_>, kind: &str) -> PyResult<Vec<(&'static str, &'static str)>> {
    let kind = crate::pool::PoolKind::parse(kind).map_err(|e| to_py(py, e))?;
    Ok(crate::support::served_pairs(kind)
        .into_iter()
        .map(|(l, b)| (l.name(), b.name()))
        .collect())
}

/// Layouts SGLang's own class of a pool kind serves and hostkv_rs does not: install() hands a
/// pool with one of them to SGLang.
#[pyfunction]
fn handed_back_layouts(py: Python<'_>, kind: &str) -> PyResult<Vec<&'static str>> {
    let kind = crate::pool::PoolKind::parse(kind).map_err(|e| to_py(py, e))?;
    Ok(crate::support::handed_back(kind))
}

/// Refuses, with SGLang's text for a pool of `kind`, a `layout` hostkv_rs does not build (a
/// layout argument that is not a string is shown as Python shows it: `None`).
#[pyfunction]
fn check_layout(py: Python<'_>, kind: &str, layout: &Bound<'_, PyAny>) -> PyResult<()> {
    let kind = crate::pool::PoolKind::parse(kind).map_err(|e| to_py(py, e))?;
    let name = spec::layout_name(py, kind, layout)?;
    crate::support::build(kind, &name)
        .map(drop)
        .map_err(|e| to_py(py, e))
}

#[pyfunction]
fn runtime_info(py: Python<'_>) -> String {
    format!(
        "hostkv_rs {}; {}",
        env!("CARGO_PKG_VERSION"),
        py.detach(cuda::runtime_info)
    )
}

/// `dst[:] = src` with streaming (non-temporal) stores on this thread, without the GIL: the
/// benchmarks' second copy yardstick (what a copy that skips the read-for-ownership costs).
/// Both are C-contiguous byte buffers of one length (numpy arrays, memoryviews, `HostRegion`s),
/// `dst` writable, the two not overlapping; the caller keeps both unchanged during the call.
#[pyfunction]
fn stream_copy(py: Python<'_>, dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    let d = pyo3::buffer::PyBuffer::<u8>::get(dst)?;
    let s = pyo3::buffer::PyBuffer::<u8>::get(src)?;
    if !d.is_c_contiguous() || !s.is_c_contiguous() {
        return Err(value_err("stream_copy needs C-contiguous buffers"));
    }
    if d.readonly() {
        return Err(value_err("stream_copy: dst is read-only"));
    }
    let (dp, sp, n) = (d.buf_ptr() as usize, s.buf_ptr() as usize, d.len_bytes());
    if s.len_bytes() != n {
        return Err(value_err(format!(
            "stream_copy: dst has {n} bytes, src {}",
            s.len_bytes()
        )));
    }
    if n > 0 && dp < sp + n && sp < dp + n {
        return Err(value_err("stream_copy: dst and src overlap"));
    }
    py.detach(|| {
        // SAFETY: both buffers are held (exported) for this call, C-contiguous, `n` bytes long,
        // `dst` writable, and they do not overlap (checked above); the caller keeps them
        // unchanged meanwhile (the documented contract, as for `digest`).
        let (src, dst) = unsafe {
            (
                std::slice::from_raw_parts(sp as *const u8, n),
                std::slice::from_raw_parts_mut(dp as *mut u8, n),
            )
        };
        crate::cpu::copy_streaming_fenced(src, dst);
    });
    Ok(())
}

/// XXH3-128 of the bytes of `buffers` (objects with the buffer protocol, C-contiguous: numpy
/// arrays, memoryviews, `HostRegion`s) taken in order as one byte string, hashed without the
/// GIL. The caller keeps the bytes unchanged during the call (the L3 tier hashes pages it is
/// saving or has just loaded).
#[pyfunction]
fn digest(py: Python<'_>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<u128> {
    let views = buffers
        .iter()
        .map(|b| {
            let view = pyo3::buffer::PyBuffer::<u8>::get(b)?;
            if !view.is_c_contiguous() {
                return Err(value_err("digest needs C-contiguous buffers"));
            }
            Ok(view)
        })
        .collect::<PyResult<Vec<_>>>()?;
    let parts: Vec<(usize, usize)> = views
        .iter()
        .map(|v| (v.buf_ptr() as usize, v.len_bytes()))
        .collect();
    Ok(py.detach(|| {
        crate::digest::digest128(parts.iter().map(|&(ptr, len)| {
            // SAFETY: each (ptr, len) is a C-contiguous buffer held by its `PyBuffer` in
            // `views`, alive until this function returns; its bytes are readable, and the
            // caller keeps them unchanged for the call (documented above).
            unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
        }))
    }))
}

/// `(bytes, source)`: what this process's memory cgroup still allows (the tightest level of
/// cgroup v2, else v1's memory controller), or None where no level sets a limit. `root` is the
/// cgroup mount and `self_cgroup` the process's cgroup file (parameters so tests can point them
/// at fake trees).
#[pyfunction]
fn cgroup_memory_limit(
    py: Python<'_>,
    root: std::path::PathBuf,
    self_cgroup: std::path::PathBuf,
) -> Option<(u64, String)> {
    py.detach(|| crate::cgroup::memory_limit(&root, &self_cgroup))
        .map(|limit| (limit.available, limit.source))
}

/// Raises TransferError if a kernel recorded a bad device-resident index since the last check.
#[pyfunction]
fn check_device_errors(py: Python<'_>) -> PyResult<()> {
    cuda::check_device_errors().map_err(|e| to_py(py, e))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<region::PyHostRegion>()?;
    m.add_class::<host_pool::PyHostPool>()?;
    m.add_class::<layer_map::PyLayerMap>()?;
    m.add_class::<spec::PyPoolSpec>()?;
    m.add_function(wrap_pyfunction!(digest, m)?)?;
    m.add_function(wrap_pyfunction!(stream_copy, m)?)?;
    m.add_function(wrap_pyfunction!(extent::tensor_extent_layout, m)?)?;
    m.add_class::<unified::PyPageUnifiedLayout>()?;
    m.add_class::<binding::PyDeviceBinding>()?;
    m.add_class::<v4::PyV4Transfers>()?;
    m.add("LayerIndexError", errors::layer_index_error_type(py)?)?;
    m.add("PageIndexError", errors::page_index_error_type(py)?)?;
    m.add("C4_PAGE_TOKENS", crate::pool::c4::PAGE_TOKENS)?;
    m.add("C4_VALUE_BYTES", crate::pool::c4::VALUE_BYTES)?;
    m.add("C4_VALUES_PER_ROW", crate::pool::c4::VALUES_PER_ROW)?;
    m.add("C4_SCALES_PER_ROW", crate::pool::c4::SCALES_PER_ROW)?;
    m.add("C4_SCALE_BYTES", crate::pool::c4::SCALE_BYTES)?;
    m.add("C4_ROW_BYTES", crate::pool::c4::ROW_BYTES)?;
    m.add("TransferError", errors::transfer_error_type(py)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(runtime_info, m)?)?;
    m.add_function(wrap_pyfunction!(supported_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(handed_back_layouts, m)?)?;
    m.add_function(wrap_pyfunction!(check_layout, m)?)?;
    m.add_function(wrap_pyfunction!(binding::device_row_pitch, m)?)?;
    m.add_function(wrap_pyfunction!(check_device_errors, m)?)?;
    m.add_function(wrap_pyfunction!(cgroup_memory_limit, m)?)?;
    m.add_function(wrap_pyfunction!(indices::py_as_index_array, m)?)?;
    m.add_function(wrap_pyfunction!(indices::py_as_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(indices::py_check_storage, m)?)?;
    m.add_function(wrap_pyfunction!(indices::py_check_page_values, m)?)?;
    m.add_function(wrap_pyfunction!(indices::py_refuse_nested, m)?)?;
    Ok(())
}
