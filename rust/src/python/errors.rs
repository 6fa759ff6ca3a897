//! The one place core errors become Python exceptions.
//!
//! `TransferError(ValueError, RuntimeError)`: a refused transfer (SGLang's kernels raise
//! RuntimeError for bad transfer arguments, its pools ValueError, so callers may catch either);
//! `LayerIndexError` and `PageIndexError` are both a `TransferError` and an `IndexError` (what
//! SGLang's `k_buffer[layer]` / `kv_buffer[row]` raise). A structured refusal carries its fields
//! as attributes (`kind`, `side`, `position`, `value`, `bound`, ...); a driver failure carries
//! `call` and `code`.

use pyo3::exceptions::{
    PyAssertionError, PyIndexError, PyMemoryError, PyNotImplementedError, PyRuntimeError,
    PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::{ArgError, CudaError, DriverError, Error, LayoutError, PlanError};

static TRANSFER_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static LAYER_INDEX_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static PAGE_INDEX_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A new exception class; `kind` is its class-level `.kind`, what an instance raised without
/// structured fields (by Python code, or with a message alone) reports.
fn new_type<'py>(
    py: Python<'py>,
    name: &str,
    doc: &str,
    kind: &str,
    bases: Vec<Bound<'py, PyType>>,
) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("kind", kind)?;
    ns.set_item("__module__", "hostkv_rs._core")?;
    ns.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases)?;
    let ty = py
        .import("builtins")?
        .getattr("type")?
        .call1((name, bases, ns))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

pub(crate) fn transfer_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = TRANSFER_ERROR.get_or_try_init(py, || {
        new_type(
            py,
            "TransferError",
            "Bad transfer arguments (indices, lengths, layer ids); nothing was written.",
            "other",
            vec![
                py.get_type::<PyValueError>(),
                py.get_type::<PyRuntimeError>(),
            ],
        )
    })?;
    Ok(ty.bind(py))
}

pub(crate) fn layer_index_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = LAYER_INDEX_ERROR.get_or_try_init(py, || {
        let base = transfer_error_type(py)?.clone();
        new_type(
            py,
            "LayerIndexError",
            "A layer id outside the pools; nothing was copied.",
            "layer_out_of_range",
            vec![base, py.get_type::<PyIndexError>()],
        )
    })?;
    Ok(ty.bind(py))
}

pub(crate) fn page_index_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = PAGE_INDEX_ERROR.get_or_try_init(py, || {
        let base = transfer_error_type(py)?.clone();
        new_type(
            py,
            "PageIndexError",
            "A page outside the host pool; nothing was read or written.",
            "page_out_of_range",
            vec![base, py.get_type::<PyIndexError>()],
        )
    })?;
    Ok(ty.bind(py))
}

fn raise(ty: PyResult<&Bound<'_, PyType>>, message: String) -> PyErr {
    match ty {
        Ok(ty) => PyErr::from_type(ty.clone(), message),
        Err(init_failed) => init_failed,
    }
}

/// A structured transfer refusal: the exception plus its fields as attributes.
fn transfer_error(py: Python<'_>, e: PlanError) -> PyErr {
    let message = e.to_string();
    let ty = if matches!(
        e,
        PlanError::LayerOutOfRange { .. } | PlanError::DeviceLayerOutOfRange { .. }
    ) {
        layer_index_error_type(py)
    } else {
        transfer_error_type(py)
    };
    let err = raise(ty, message);
    if let Err(failed) = set_fields(py, &err, &e) {
        return failed;
    }
    err
}

fn set_fields(py: Python<'_>, err: &PyErr, e: &PlanError) -> PyResult<()> {
    let value = err.value(py);
    let set = |name: &str, v: Bound<'_, PyAny>| value.setattr(name, v);
    use PlanError as T;
    let kind = match e {
        T::Negative { .. } => "negative",
        T::OutOfRange { .. } => "out_of_range",
        T::TokenOutOfRange { .. } => "token_out_of_range",
        T::LengthMismatch { .. } => "length_mismatch",
        T::PartialPage { .. } => "partial_page",
        T::LayerOutOfRange { .. } => "layer_out_of_range",
        T::DeviceLayerOutOfRange { .. } => "device_layer_out_of_range",
        T::PageOutsideDevice { .. } => "page_outside_device",
        T::PageNotAligned { .. } => "page_not_aligned",
        T::PageRunBroken { .. } => "page_run_broken",
        T::Changed { .. } => "changed",
        T::Other(_) => "other",
    };
    set("kind", kind.into_pyobject(py)?.into_any())?;
    let int = |v: i128| -> PyResult<Bound<'_, PyAny>> { Ok(v.into_pyobject(py)?.into_any()) };
    let side = |s: crate::error::Side| s.name().into_pyobject(py).map(|v| v.into_any());
    match *e {
        T::Negative {
            side: s,
            position,
            value: v,
        }
        | T::Changed {
            side: s,
            position,
            value: v,
        } => {
            set("side", side(s)?)?;
            set("position", int(position as i128)?)?;
            set("value", int(v as i128)?)?;
        }
        T::OutOfRange {
            side: s,
            position,
            value: v,
            bound,
        } => {
            set("side", side(s)?)?;
            set("position", int(position as i128)?)?;
            set("value", int(v as i128)?)?;
            set("bound", int(bound as i128)?)?;
        }
        T::TokenOutOfRange {
            side: s,
            min,
            max,
            bound,
        } => {
            set("side", side(s)?)?;
            set("min", int(min as i128)?)?;
            set("max", int(max as i128)?)?;
            set("bound", int(bound as i128)?)?;
        }
        T::LengthMismatch { host, device, .. } => {
            set("host_len", int(host as i128)?)?;
            set("device_len", int(device as i128)?)?;
        }
        T::PartialPage { len, page_size, .. } => {
            set("len", int(len as i128)?)?;
            set("page_size", int(page_size as i128)?)?;
        }
        T::LayerOutOfRange { layer, layers } | T::DeviceLayerOutOfRange { layer, layers } => {
            set("layer", int(layer as i128)?)?;
            set("bound", int(layers as i128)?)?;
        }
        T::PageOutsideDevice {
            start,
            position,
            rows,
            ..
        } => {
            set("side", side(crate::error::Side::Device)?)?;
            set("position", int(position as i128)?)?;
            set("value", int(start as i128)?)?;
            set("bound", int(rows as i128)?)?;
        }
        T::PageNotAligned {
            page,
            side: s,
            value: v,
            position,
            page_size,
        } => {
            set("page", int(page as i128)?)?;
            set("side", side(s)?)?;
            set("position", int(position as i128)?)?;
            set("value", int(v as i128)?)?;
            set("page_size", int(page_size as i128)?)?;
        }
        T::PageRunBroken {
            page,
            side: s,
            value: v,
            position,
            ..
        } => {
            set("page", int(page as i128)?)?;
            set("side", side(s)?)?;
            set("position", int(position as i128)?)?;
            set("value", int(v as i128)?)?;
        }
        T::Other(_) => {}
    }
    Ok(())
}

fn driver_error(py: Python<'_>, e: DriverError) -> PyErr {
    let err = PyRuntimeError::new_err(e.to_string());
    let value = err.value(py);
    let set = || -> PyResult<()> {
        value.setattr("call", e.call.as_str())?;
        value.setattr("code", e.code)?;
        value.setattr("name", e.name.as_str())
    };
    match set() {
        Ok(()) => err,
        Err(failed) => failed,
    }
}

/// The one mapping from the core's error layers to Python exceptions.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    match e {
        Error::Layout(LayoutError::Unsupported(m) | LayoutError::Geometry(m)) => {
            PyValueError::new_err(m)
        }
        Error::Plan(t) => transfer_error(py, t),
        Error::Arg(ArgError::Value(m)) => PyValueError::new_err(m),
        Error::Arg(ArgError::LayerIndex(m)) => raise(layer_index_error_type(py), m),
        Error::Arg(ArgError::PageIndex(m)) => raise(page_index_error_type(py), m),
        Error::Arg(ArgError::Assertion(m)) => PyAssertionError::new_err(m),
        Error::Arg(ArgError::NotImplemented(m)) => PyNotImplementedError::new_err(m),
        Error::Arg(ArgError::State(m)) => PyRuntimeError::new_err(m),
        Error::Mem(m) => PyMemoryError::new_err(m.to_string()),
        Error::Cuda(CudaError::Driver(d)) => driver_error(py, d),
        Error::Cuda(CudaError::Unavailable(m) | CudaError::Refused(m)) => {
            PyRuntimeError::new_err(m)
        }
        // Internal to `cuda::try_execute` (retried detached); never expected here.
        e @ Error::Cuda(CudaError::WouldBlock) => PyRuntimeError::new_err(e.to_string()),
    }
}

pub(crate) fn transfer_err(py: Python<'_>, msg: String) -> PyErr {
    to_py(py, Error::transfer(msg))
}

// The refusals the PyO3 layer makes itself (arguments it reads from Python objects), by class:
// the layer names the class through these, so every class is picked in this file.
pub(crate) fn type_err(message: impl Into<String>) -> PyErr {
    PyTypeError::new_err(message.into())
}

pub(crate) fn value_err(message: impl Into<String>) -> PyErr {
    PyValueError::new_err(message.into())
}

pub(crate) fn runtime_err(message: impl Into<String>) -> PyErr {
    PyRuntimeError::new_err(message.into())
}

pub(crate) fn not_implemented_err(message: impl Into<String>) -> PyErr {
    PyNotImplementedError::new_err(message.into())
}
