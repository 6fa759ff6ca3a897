//! Index arguments and caller tensors as the core reads them: contiguous int32/int64 index
//! arrays at a known address, and dense tensors whose storage really holds their elements.
//!
//! The bindings read a contiguous 1-D int32/int64 tensor in place (`binding::fast_index`);
//! everything else (lists, numpy arrays, other integer dtypes, strided or device-resident
//! tensors) is converted here, through torch, with a refusal that names what was wrong. The
//! same functions are `_core`'s for the Python pools (free lists, flat pages, V4's buffers), so
//! one text serves every path.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::binding::{fast_index, torch};
use super::errors::{type_err, value_err};
use super::tensor_calls;

fn is_tensor(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    value.is_instance(torch(value.py())?.tensor.bind(value.py()))
}

fn is_one_of<'a>(dtype: &Bound<'_, PyAny>, of: impl IntoIterator<Item = &'a Py<PyAny>>) -> bool {
    of.into_iter().any(|d| dtype.is(d.bind(dtype.py())))
}

/// Refuses a nested tensor by name: its rows live in separate buffers, and torch's own size and
/// alias calls fail on it with internal errors.
pub(crate) fn refuse_nested(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    let py = tensor.py();
    if tensor.getattr(intern!(py, "is_nested"))?.is_truthy()? {
        return Err(type_err(format!(
            "{what}: expected a dense (strided) tensor, got a nested tensor"
        )));
    }
    Ok(())
}

/// `tensor` as a plain `torch.Tensor` whose methods only torch answers, for reading its values
/// through its address. A subclass's own methods (or its `__torch_function__`), and an attribute
/// set on the object itself (`t.data_ptr = ...`), could report an address or a shape its
/// storage does not have, and the core would read there. The alias (made with subclass overrides
/// off) shares the storage, sizes and offset.
pub(crate) fn plain_tensor<'py>(
    tensor: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let py = tensor.py();
    let o = torch(py)?;
    let plain_type = tensor.get_type().is(o.tensor.bind(py));
    if plain_type {
        let own = tensor.getattr(intern!(py, "__dict__"))?;
        if !own.is_truthy()? {
            return Ok(tensor.clone());
        }
    }
    refuse_nested(tensor, what)?;
    let guard = o.subclass_overrides_off.bind(py).call0()?;
    guard.call_method0(intern!(py, "__enter__"))?;
    let alias = o
        .tensor
        .bind(py)
        .call_method1(intern!(py, "as_subclass"), (tensor, o.tensor.bind(py)));
    let none = py.None();
    guard.call_method1(intern!(py, "__exit__"), (&none, &none, &none))?;
    alias
}

/// Whether `tensor`'s storage really holds the elements its shape claims (a storage shrunk with
/// `untyped_storage().resize_()` does not, and reading or writing through the tensor's address
/// would then leave the allocation), and how many bytes it holds.
fn storage_holds(tensor: &Bound<'_, PyAny>) -> PyResult<(bool, u64)> {
    let py = tensor.py();
    let m = tensor_calls::methods(py)?;
    if m.ask(&m.numel, tensor)?.extract::<u64>()? == 0 {
        return Ok((true, 0));
    }
    let shape: Vec<i128> = tensor.getattr(intern!(py, "shape"))?.extract()?;
    let strides: Vec<i128> = m.ask(&m.stride, tensor)?.extract()?;
    let offset: i128 = m.ask(&m.storage_offset, tensor)?.extract()?;
    let element: i128 = m.ask(&m.element_size, tensor)?.extract()?;
    let nbytes: u64 = m
        .ask(&m.storage_nbytes, &m.ask(&m.untyped_storage, tensor)?)?
        .extract()?;
    // Bytes up to the last element; a view past any count (only a meta tensor can claim one)
    // overflows and is not held.
    let end = shape
        .iter()
        .zip(&strides)
        .try_fold(offset, |last, (extent, stride)| {
            (extent - 1).checked_mul(*stride)?.checked_add(last)
        })
        .and_then(|last| last.checked_add(1)?.checked_mul(element));
    Ok((end.is_some_and(|end| end <= nbytes as i128), nbytes))
}

/// The address of the tensor's storage, 0 where it has none to read (torch raises for a
/// functionalized tensor's).
fn storage_data(tensor: &Bound<'_, PyAny>) -> PyResult<u64> {
    let m = tensor_calls::methods(tensor.py())?;
    let data = m
        .ask(&m.untyped_storage, tensor)
        .and_then(|s| m.ask(&m.storage_data_ptr, &s));
    match data {
        Ok(ptr) => ptr.extract(),
        Err(e) if e.is_instance_of::<PyRuntimeError>(tensor.py()) => Ok(0),
        Err(e) => Err(e),
    }
}

fn check_dense_storage(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    let py = tensor.py();
    let layout = tensor.getattr(intern!(py, "layout"))?;
    if !layout.is(torch(py)?.strided.bind(py)) {
        // A sparse or nested tensor has no one storage at an address to read.
        return Err(type_err(format!(
            "{what}: expected a dense (strided) tensor, got {}",
            layout.str()?
        )));
    }
    let (holds, nbytes) = match storage_holds(tensor) {
        Ok(found) => found,
        Err(e) if e.is_instance_of::<PyRuntimeError>(py) => {
            // A nested tensor (one of 0-d parts is 1-D, strided and a plain torch.Tensor, so
            // it reaches the per-call fast path) has no sizes to read: say so.
            refuse_nested(tensor, what)?;
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    let m = tensor_calls::methods(py)?;
    if !holds {
        return Err(value_err(format!(
            "{what}: the tensor's storage holds {nbytes} bytes, fewer than its shape {} \
             (offset {}) needs",
            shape_text(tensor)?,
            m.ask(&m.storage_offset, tensor)?
        )));
    }
    let on_meta = tensor
        .getattr(intern!(py, "device"))?
        .getattr(intern!(py, "type"))?
        .extract::<&str>()?
        == "meta";
    if m.ask(&m.numel, tensor)?.extract::<u64>()? > 0 && !on_meta && storage_data(tensor)? == 0 {
        return Err(value_err(format!(
            "{what}: the tensor's storage has no memory to read or write (a functionalized or \
             fake tensor?)"
        )));
    }
    Ok(())
}

/// A tensor's shape as Python prints the tuple: `(2, 3)`, `(5,)`, `()`.
fn shape_text(tensor: &Bound<'_, PyAny>) -> PyResult<String> {
    let py = tensor.py();
    let shape: Vec<i64> = tensor.getattr(intern!(py, "shape"))?.extract()?;
    Ok(PyTuple::new(py, shape)?.repr()?.to_string())
}

/// Refuses a tensor whose elements its storage does not hold at an address (nested, sparse,
/// a storage shrunk under it, a functionalized or fake tensor), naming `what`.
pub(crate) fn check_storage(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    refuse_nested(tensor, what)?;
    check_dense_storage(tensor, what)
}

/// `check_storage` for a page of values written into a pool.
pub(crate) fn check_page_values(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    let py = tensor.py();
    if tensor.getattr(intern!(py, "is_quantized"))?.is_truthy()? {
        // Its storage holds integer codes, not the values (torch refuses to copy it raw).
        return Err(type_err(format!(
            "{what}: expected a tensor of plain values, got quantized {}",
            tensor.getattr(intern!(py, "dtype"))?.str()?
        )));
    }
    check_storage(tensor, what)
}

/// `array` in a form `torch.as_tensor` takes: it refuses negative strides (`a[::-1]`) and
/// non-native byte order, and warns on a read-only array; a copy fixes each.
fn numpy_readable<'py>(array: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = array.py();
    let mut array = array.clone();
    let dtype = array.getattr(intern!(py, "dtype"))?;
    if !dtype.getattr(intern!(py, "isnative"))?.is_truthy()? {
        let native = dtype.call_method1(intern!(py, "newbyteorder"), ("=",))?;
        array = array.call_method1(intern!(py, "astype"), (native,))?;
    }
    let strides: Vec<i64> = array.getattr(intern!(py, "strides"))?.extract()?;
    let writeable = array
        .getattr(intern!(py, "flags"))?
        .getattr(intern!(py, "writeable"))?
        .is_truthy()?;
    if strides.iter().any(|&s| s < 0) || !writeable {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("order", "C")?;
        array = torch(py)?.np_array.bind(py).call((array,), Some(&kwargs))?;
    }
    Ok(array)
}

/// The first int outside int64 in nested lists/tuples (for the refusal's text).
fn first_past_int64(values: &Bound<'_, PyAny>) -> PyResult<String> {
    let mut stack = vec![values.clone()];
    while let Some(value) = stack.pop() {
        if let Ok(list) = value.cast::<PyList>() {
            stack.extend(list.iter().rev());
        } else if let Ok(tuple) = value.cast::<PyTuple>() {
            stack.extend(tuple.iter().rev());
        } else if value.is_instance_of::<pyo3::types::PyInt>() && value.extract::<i64>().is_err() {
            return Ok(value.str()?.to_string());
        }
    }
    Ok("(a value)".to_owned())
}

/// `indices` (a tensor, numpy array, list, ...) as a tensor of its own dtype, or TypeError /
/// ValueError naming what it is. No dtype is forced: int64 would truncate 1.5 to 1.
pub(crate) fn as_tensor<'py>(indices: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = indices.py();
    if is_tensor(indices)? {
        return Ok(indices.clone());
    }
    if indices.is_none() {
        return Err(type_err("index tensors must be integer tensors, got None"));
    }
    let o = torch(py)?;
    let mut source = indices.clone();
    if indices.is_instance(o.ndarray.bind(py))? {
        source = numpy_readable(indices)?;
    }
    let converted = match o.as_tensor.bind(py).call1((&source,)) {
        Ok(converted) => converted,
        Err(e)
            if e.is_instance_of::<PyTypeError>(py)
                || e.is_instance_of::<PyValueError>(py)
                || e.is_instance_of::<PyRuntimeError>(py) =>
        {
            let text = e.value(py).str()?.to_string();
            if text.contains("Overflow") {
                // torch's words for a Python int outside int64 ("Overflow when unpacking long").
                return Err(value_err(format!(
                    "index {} does not fit in int64 (indices are slots in [0, 2**63))",
                    first_past_int64(indices)?
                )));
            }
            return Err(type_err(format!(
                "index tensors must be integer tensors, got {}: {text}",
                indices.get_type().name()?
            )));
        }
        Err(e) => return Err(e),
    };
    let m = tensor_calls::methods(py)?;
    let empty = m.ask(&m.numel, &converted)?.extract::<u64>()? == 0;
    if empty
        && converted
            .getattr(intern!(py, "dtype"))?
            .getattr(intern!(py, "is_floating_point"))?
            .is_truthy()?
    {
        return converted.call_method1(intern!(py, "to"), (o.int64.bind(py),)); // [] defaults to float32
    }
    Ok(converted)
}

/// Refuses a uint64 index past 2**63 - 1: the int64 the core reads would wrap to a negative
/// index.
fn refuse_past_int64(indices: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = indices.py();
    // Same bits as int64: a uint64 past 2**63 - 1 reads negative.
    let as_signed = indices
        .call_method1(intern!(py, "reshape"), (-1,))?
        .call_method0(intern!(py, "contiguous"))?
        .call_method1(intern!(py, "view"), (torch(py)?.int64.bind(py),))?;
    let too_big = as_signed.call_method1(intern!(py, "lt"), (0,))?;
    if too_big.call_method0(intern!(py, "any"))?.is_truthy()? {
        let position: i64 = too_big
            .call_method0(intern!(py, "nonzero"))?
            .get_item((0, 0))?
            .extract()?;
        let value = as_signed.get_item(position)?.extract::<i64>()? as i128 + (1i128 << 64);
        return Err(value_err(format!(
            "index {value} at position {position} does not fit in int64 (indices are slots in \
             [0, 2**63))"
        )));
    }
    Ok(())
}

/// `indices` as a contiguous 1-D int32/int64 tensor, on `device` when given.
///
/// Other integer dtypes are widened to int64; lists and numpy arrays are accepted too (an empty
/// list is an empty int64 array). Float, complex and bool values are refused rather than
/// truncated, and so are tensors on the meta device, which hold no values. The caller keeps the
/// returned tensor alive until the core has read it.
pub(crate) fn as_index_array<'py>(
    indices: &Bound<'py, PyAny>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = indices.py();
    let o = torch(py)?;
    let m = tensor_calls::methods(py)?;
    let mut value = indices.clone();
    if is_tensor(&value)? {
        value = plain_tensor(&value, "index tensor")?;
        if let Some(host_side) = ready_on_host(&value, device)? {
            // Already what the core reads, as the transfers take it (read in place from torch's
            // objects where they can be read, its storage checked): returned as it is.
            if fast_index(py, o, &value, host_side)?.is_some() {
                return Ok(value);
            }
        }
    }
    value = as_tensor(&value)?;
    if value
        .getattr(intern!(py, "device"))?
        .getattr(intern!(py, "type"))?
        .extract::<&str>()?
        == "meta"
    {
        return Err(value_err("index tensors on the meta device hold no values"));
    }
    // A negative view (torch._neg_view) stores the values un-negated: read what it says.
    value = value.call_method0(intern!(py, "resolve_neg"))?;
    let layout = value.getattr(intern!(py, "layout"))?;
    if !layout.is(o.strided.bind(py)) {
        return Err(type_err(format!(
            "index tensors must be dense (strided) tensors, got {}",
            layout.str()?
        )));
    }
    check_storage(&value, "index tensor")?;
    let dtype = value.getattr(intern!(py, "dtype"))?;
    if !is_one_of(&dtype, [&o.int32, &o.int64]) {
        if !is_one_of(&dtype, &o.widened) {
            return Err(type_err(format!(
                "index tensors must be integer tensors, got {}",
                dtype.str()?
            )));
        }
        if dtype.is(o.uint64.bind(py)) && m.ask(&m.numel, &value)?.extract::<u64>()? > 0 {
            refuse_past_int64(&value)?;
        }
        value = value.call_method1(intern!(py, "to"), (o.int64.bind(py),))?;
    }
    if let Some(device) = device {
        if !value.getattr(intern!(py, "device"))?.eq(device)? {
            value = value.call_method1(intern!(py, "to"), (device,))?;
        }
    }
    value = value.call_method1(intern!(py, "reshape"), (-1,))?;
    if !m.ask(&m.is_contiguous, &value)?.is_truthy()? {
        value = value.call_method0(intern!(py, "contiguous"))?;
    }
    Ok(value)
}

/// Whether `indices` may be returned as it is when it is a ready index array, and then whether
/// it must be on the host: exactly a `torch.Tensor` with no attribute of its own (one could
/// shadow a method the caller uses next; `plain_tensor` gives such a tensor), not nested, asked
/// for no device or for the CPU.
fn ready_on_host(
    indices: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<bool>> {
    let py = indices.py();
    if !indices.get_type().is(torch(py)?.tensor.bind(py))
        || indices
            .getattr(intern!(py, "__dict__"))?
            .is_truthy()?
        // A nested tensor of 0-d parts reads as one strided row: refused by name below.
        || indices
            .getattr(intern!(py, "is_nested"))?
            .is_truthy()?
    {
        return Ok(None);
    }
    Ok(match device {
        None => Some(false),
        // Anything but a CPU `torch.device` (a device string included) takes the conversion.
        Some(d) => d
            .getattr(intern!(py, "type"))
            .ok()
            .is_some_and(|kind| kind.extract::<&str>().is_ok_and(|kind| kind == "cpu"))
            .then_some(true),
    })
}

#[pyfunction]
#[pyo3(name = "as_index_array", signature = (indices, device = None))]
pub(super) fn py_as_index_array<'py>(
    indices: &Bound<'py, PyAny>,
    device: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    as_index_array(indices, device.as_ref())
}

#[pyfunction]
#[pyo3(name = "as_tensor")]
pub(super) fn py_as_tensor<'py>(indices: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    as_tensor(indices)
}

#[pyfunction]
#[pyo3(name = "check_storage")]
pub(super) fn py_check_storage(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    check_storage(tensor, what)
}

#[pyfunction]
#[pyo3(name = "check_page_values")]
pub(super) fn py_check_page_values(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    check_page_values(tensor, what)
}

#[pyfunction]
#[pyo3(name = "refuse_nested")]
pub(super) fn py_refuse_nested(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    refuse_nested(tensor, what)
}
