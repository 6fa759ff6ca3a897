//! Argument conversion shared by the bindings: integers with named ranges, index arrays.

use pyo3::prelude::*;

use super::errors::{type_err, value_err};
use crate::request::IndexMap;

/// `value` as the Python int `operator.index` gives, or the TypeError naming `name` for a
/// non-integer (a bool included: it is refused rather than read as 0 or 1; an `__index__` that
/// raises TypeError or returns something else than an int too). Anything else its `__index__`
/// raises (KeyboardInterrupt, SystemExit, MemoryError, a ValueError of its own) passes through
/// unchanged, as `operator.index` lets it.
pub(crate) fn py_int<'py>(value: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let py = value.py();
    let not_an_integer = || -> PyResult<Bound<'py, PyAny>> {
        Err(type_err(format!(
            "{name} must be an integer, got {}",
            value.repr()?
        )))
    };
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return not_an_integer();
    }
    // SAFETY: `value` is a live object (the GIL is held); PyNumber_Index returns a new reference
    // or NULL with the error set, which `from_owned_ptr_or_err` takes over.
    match unsafe { Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyNumber_Index(value.as_ptr())) } {
        Ok(int) => Ok(int),
        Err(err) if err.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => not_an_integer(),
        Err(err) => Err(err),
    }
}

/// An integer argument in `[lo, hi]`: TypeError for a non-integer (a bool included), ValueError
/// naming the parameter, the value and the range otherwise (never a bare OverflowError).
pub(crate) fn int_in(
    value: &Bound<'_, PyAny>,
    name: &str,
    lo: u128,
    hi: u128,
    range: &str,
) -> PyResult<u128> {
    let int = py_int(value, name)?;
    match int.extract::<i128>() {
        Ok(v) if v >= lo as i128 && (v as u128) <= hi => Ok(v as u128),
        _ => Err(value_err(format!(
            "{name} must lie in {range}, got {}",
            int.repr()?
        ))),
    }
}

/// A string argument, `default` for None; a TypeError naming the parameter and what it takes
/// for anything else (the binding layer's own message names only the types).
pub(crate) fn str_or(
    value: Option<&Bound<'_, PyAny>>,
    name: &str,
    default: &str,
    allowed: &str,
) -> PyResult<String> {
    match value.filter(|v| !v.is_none()) {
        None => Ok(default.to_owned()),
        Some(v) => match v.cast::<pyo3::types::PyString>() {
            Ok(s) => Ok(s.to_str()?.to_owned()),
            Err(_) => Err(type_err(format!(
                "{name} must be a string ({allowed}), got {}",
                v.repr()?
            ))),
        },
    }
}

/// How both index arrays of a transfer are read (`crate::index_map`): None (every element as
/// is), `("dcp", dcp_size, dcp_rank)` (whole widened pages), `("dcp_share", dcp_size,
/// dcp_rank)` (any run), `("page_rows", page_size)`, `("c4_value",)` or
/// `("c4_scale",)`.
pub(crate) fn index_map(value: Option<&Bound<'_, PyAny>>) -> PyResult<IndexMap> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(IndexMap::Identity);
    };
    let allowed = "None, ('dcp', dcp_size, dcp_rank), ('dcp_share', dcp_size, dcp_rank), \
                   ('page_rows', page_size), ('c4_value',) or ('c4_scale',)";
    let bad = || -> PyResult<IndexMap> {
        Err(value_err(format!(
            "index_map must be {allowed}, got {}",
            value.repr()?
        )))
    };
    let Ok(items) = value.extract::<Vec<Bound<'_, PyAny>>>() else {
        return bad();
    };
    let Some(Ok(name)) = items.first().map(|n| n.extract::<String>()) else {
        return bad();
    };
    let small = |i: usize, what: &str| -> PyResult<u32> {
        Ok(int_in(&items[i], what, 0, u32::MAX as u128, "[0, 2**32)")? as u32)
    };
    let map = match (name.as_str(), items.len()) {
        ("dcp", 3) => IndexMap::Dcp {
            size: small(1, "dcp_size")?,
            rank: small(2, "dcp_rank")?,
        },
        ("dcp_share", 3) => IndexMap::DcpShare {
            size: small(1, "dcp_size")?,
            rank: small(2, "dcp_rank")?,
        },
        ("page_rows", 2) => IndexMap::PageRows {
            page: small(1, "page_size")?,
        },
        ("c4_value", 1) => IndexMap::C4Value,
        ("c4_scale", 1) => IndexMap::C4Scale,
        _ => return bad(),
    };
    map.check()
        .map_err(|e| value_err(format!("index_map: {e}")))?;
    Ok(map)
}
