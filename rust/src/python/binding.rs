//! `_core.DeviceBinding`: a host pool's device side, checked once and held in Rust.
//!
//! A pool captures its device layer tensors when it is built (SGLang 0.5.22+ does the same; 0.5.23
//! hands over only the layers this rank owns). The binding maps controller layer ids to (host
//! layer, device tensor), checks every tensor on first use (type, device, contiguity, storage,
//! dtype, head split, row bytes), and then serves each transfer with only the layer id and the two
//! index tensors: per call it checks the index tensors, then re-reads the extent of the tensors
//! it touches (SGLang reads the device pointer when it copies, so a tensor whose storage was
//! swapped is checked again), and runs the engine it chose when it was built. Nothing runs
//! Python between that last read and the copy (`prepare`).
//!
//! Controller layer ids: a target layer is the device pool's local layer id; packed MTP draft `i`
//! comes as `device_layer_num + i` with `is_draft=True`. Host layers: the owned target layers in
//! order, then the drafts at `target_layer_num + i` (under layer sharding `target_layer_num` may
//! exceed the owned count by one; that host layer stays unused).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyType};

use super::args;
use super::errors::{not_implemented_err, runtime_err, to_py, type_err, value_err};
use super::extent;
use super::host_pool::PyHostPool;
use super::indices;
use super::spec::PyPoolSpec;
use super::tensor_calls;
use crate::config;
use crate::engine::{self, CopyEngine};
use crate::error::{Error, PlanError};
use crate::fork;
use crate::layer_map::LayerMap;
use crate::request::{Backend, DeviceMemory, IndexArray, IndexMap, IndexWidth, Op};

/// The torch (and numpy) objects the bindings and the index conversions compare against or
/// call, looked up once per process.
pub(super) struct Torch {
    pub(super) tensor: Py<PyType>,
    parameter: Py<PyType>,
    pub(super) int32: Py<PyAny>,
    pub(super) int64: Py<PyAny>,
    pub(super) uint64: Py<PyAny>,
    /// Integer dtypes an index conversion widens to int64. Anything else (floats, bool,
    /// complex, and the quantized and bit-packed dtypes, which `Tensor.to(torch.int64)` cannot
    /// even convert) is refused by name.
    pub(super) widened: Vec<Py<PyAny>>,
    pub(super) strided: Py<PyAny>,
    pub(super) cpu: Py<PyAny>,
    pub(super) as_tensor: Py<PyAny>,
    /// `torch._C.DisableTorchFunctionSubclass`.
    pub(super) subclass_overrides_off: Py<PyAny>,
    pub(super) ndarray: Py<PyType>,
    pub(super) np_array: Py<PyAny>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

pub(super) fn torch(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let numpy = py.import("numpy")?;
        let attr = |name: &str| -> PyResult<Py<PyAny>> { Ok(torch.getattr(name)?.unbind()) };
        Ok(Torch {
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            parameter: torch
                .getattr("nn")?
                .getattr("Parameter")?
                .cast_into::<PyType>()?
                .unbind(),
            int32: attr("int32")?,
            int64: attr("int64")?,
            uint64: attr("uint64")?,
            widened: ["uint8", "int8", "int16", "uint16", "uint32", "uint64"]
                .into_iter()
                .map(attr)
                .collect::<PyResult<_>>()?,
            strided: attr("strided")?,
            cpu: torch.getattr("device")?.call1(("cpu",))?.unbind(),
            as_tensor: attr("as_tensor")?,
            subclass_overrides_off: torch
                .getattr("_C")?
                .getattr("DisableTorchFunctionSubclass")?
                .unbind(),
            ndarray: numpy.getattr("ndarray")?.cast_into::<PyType>()?.unbind(),
            np_array: numpy.getattr("array")?.unbind(),
        })
    })
}

/// What one device tensor was when it was checked: a transfer uses the checked pointer and rows
/// only while the tensor still has this data pointer and byte size, is still contiguous (a
/// strided one: still has the shape and strides checked), and its storage still has this byte
/// size. The storage object is held, so the storage it names cannot
/// be freed behind the check: a tensor `set_` to other memory changes its pointer (two live
/// storages do not share an address), a tensor resized on its storage changes its byte size,
/// one restrided in place (`as_strided_`, `transpose_`) is no longer contiguous, and a storage
/// resized, freed or reallocated in place changes the storage's byte size; any of these sends
/// the binding through the full check again.
///
/// Where this process's torch layout was found (`extent.rs`), the same facts are read straight
/// from the tensor's and the storage's C++ objects, a few loads per tensor; otherwise a few
/// Python calls per touched tensor, each through the type's method (`tensor_calls`).
struct Snap {
    ptr: u64,
    tensor_nbytes: u64,
    storage_nbytes: u64,
    /// The tensor's storage, held so that it cannot be freed behind the check.
    storage: Py<PyAny>,
    /// The extent as torch's objects hold it, where it could be read and agreed with Python.
    read: Option<extent::Extent>,
    /// A strided tensor's (shape, strides) as checked; None for a contiguous one.
    strided: Option<(Vec<i64>, Vec<i64>)>,
}

impl Snap {
    /// `tensor`, asked through the type's methods (see `tensor_calls`); `shape` as checked,
    /// and whether it was checked as strided rows rather than contiguous.
    fn take(
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        shape: Vec<i64>,
        strided: bool,
    ) -> PyResult<Self> {
        let m = tensor_calls::methods(py)?;
        let storage = m.ask(&m.untyped_storage, tensor)?;
        let strides: Vec<i64> = m.ask(&m.stride, tensor)?.extract()?;
        // Read from torch's objects only where the snapshot also sees an in-place restride:
        // through the contiguity flag (this tensor was checked contiguous), or else the sizes
        // and strides themselves, read as Python says them.
        let read = match extent::layout(py)? {
            Some(layout) => {
                let reported = extent::reported(tensor)?;
                layout.snapshot(&reported).filter(|e| {
                    e.contiguous()
                        || e.shape_and_strides() == Some((shape.clone(), strides.clone()))
                })
            }
            None => None,
        };
        Ok(Self {
            ptr: m.ask(&m.data_ptr, tensor)?.extract()?,
            tensor_nbytes: tensor.getattr(intern!(py, "nbytes"))?.extract()?,
            storage_nbytes: m.ask(&m.storage_nbytes, &storage)?.extract()?,
            storage: storage.unbind(),
            read,
            strided: strided.then_some((shape, strides)),
        })
    }

    /// Whether `tensor` (the one this was taken of) is still what was checked, asked of Python
    /// (for a snapshot not read from torch's objects; see `PyDeviceBinding::read_holds`).
    fn holds_by_python(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<bool> {
        let m = tensor_calls::methods(py)?;
        let ptr: u64 = m.ask(&m.data_ptr, tensor)?.extract()?;
        if ptr != self.ptr {
            return Ok(false);
        }
        let nbytes: u64 = tensor.getattr(intern!(py, "nbytes"))?.extract()?;
        if nbytes != self.tensor_nbytes {
            return Ok(false);
        }
        let storage_nbytes: u64 = m.ask(&m.storage_nbytes, self.storage.bind(py))?.extract()?;
        if storage_nbytes != self.storage_nbytes {
            return Ok(false);
        }
        // As the read from torch's objects: still contiguous (the same bytes, in the same order
        // of rows; a contiguous reshape of them is written as it was checked, as SGLang's
        // kernels write a layer through its pointer and the pool's item size), or for strided
        // rows the very shape and strides checked.
        match &self.strided {
            None => m.ask(&m.is_contiguous, tensor)?.is_truthy(),
            Some((shape, strides)) => Ok(tensor
                .getattr(intern!(py, "shape"))?
                .extract::<Vec<i64>>()?
                == *shape
                && m.ask(&m.stride, tensor)?.extract::<Vec<i64>>()? == *strides),
        }
    }
}

/// The checked device side: plane-major snapshots, the smallest row count, the device.
struct CheckedDevice {
    snaps: Vec<Snap>,
    /// Rows of each position (the fewest over its planes): a transfer is bounded by the layers
    /// it touches, as SGLang indexes each layer's own buffer.
    rows: Vec<usize>,
    /// The CUDA device (a `torch.device`) whose current stream a transfer is queued on; None
    /// for CPU device pools.
    cuda: Option<Py<PyAny>>,
    /// Torch's field offsets every snapshot read from torch's objects was read through (one
    /// per process).
    layout: Option<extent::TorchLayout>,
    /// Bytes between device rows where every layer is a strided view with that one row stride
    /// (SGLang's unified pools: per-layer views of token-major entries); None: packed rows.
    row_pitch: Option<u64>,
}

/// Where a transfer runs: the engine, and for CUDA the raw stream and torch's object for it.
struct Queue {
    engine: &'static dyn CopyEngine,
    stream: u64,
    torch_stream: Option<Py<PyAny>>,
}

/// `(dtype, (heads, head_dim) or None)` as Python passes it.
type LikeArg = (Py<PyAny>, Option<(i64, i64)>);

/// The `(dtype, (heads, head_dim))` a plane's device rows must have.
struct Like {
    dtype: Py<PyAny>,
    split: Option<(i64, i64)>,
}

#[pyclass(frozen, module = "hostkv_rs._core", name = "DeviceBinding")]
pub struct PyDeviceBinding {
    /// None once the pool is destroyed. Same lock order as `checked`: held only to copy or take
    /// the reference, never while Python runs (the core is dropped after the lock is released,
    /// because dropping it can run Python finalizers and release the GIL).
    core: Mutex<Option<Py<PyHostPool>>>,
    spec: Py<PyPoolSpec>,
    /// The pool's class name, for the destroyed-pool refusal.
    name: String,
    /// How refusals name the device side ("device pool").
    what: String,
    /// Plane-major: plane `p`, position `i` at `p * count + i`.
    tensors: Vec<Py<PyAny>>,
    count: usize,
    item_bytes: Vec<u64>,
    like: Vec<Like>,
    /// Where set, device tensors are read as their bytes, in rows of the item size, whatever
    /// their shape and dtype (V4's buffers), rather than as a token dimension of rows of that
    /// size; each plane's tensors must also be whole units of its entry's bytes (V4's page
    /// rows, which the finer C4 value and scale rows tile).
    byte_rows: Option<Vec<u64>>,
    /// Controller layer ids -> (host layer, tensor position), and the backup order.
    layers: LayerMap,
    /// The engine for CPU device tensors, from HOSTKV_CPU_ENGINE when the binding was built (an
    /// unknown value is refused at the first CPU transfer, not at construction).
    cpu_engine: Result<&'static dyn CopyEngine, String>,
    /// SGLang's packed target + draft device tables (plane name, layers), with MTP drafts.
    packed: Option<(String, usize)>,
    /// The fork generation the binding was made in (its locks in a forked child: `fork::lock`).
    born: u64,
    /// The host rows this binding addresses when they are not the pool's own: some of its
    /// planes (`host_planes`), or V4's C4 value and scale rows (`HostPool::row_view`).
    view: Option<crate::request::HostGeometry>,
    /// The last full check. Lock order: this lock is innermost and never held while Python runs
    /// or the GIL is waited for (only to copy or swap the `Arc`), so a thread that holds the GIL
    /// and waits for it can never wait on a thread that holds it and waits for the GIL. Two
    /// threads may both re-check after a change; each check is complete, so either result is
    /// right.
    checked: Mutex<Option<Arc<CheckedDevice>>>,
    /// How every transfer reads both index arrays (DCP: this rank's share).
    index_map: IndexMap,
}

/// A layer id as SGLang compares it: an integer (a bool is refused rather than read as 0 or 1).
pub(super) fn layer_key(layer_id: &Bound<'_, PyAny>) -> PyResult<i64> {
    // Past i64 it cannot name a layer of any pool; SGLang's range check fails for it too.
    Ok(layer_int(layer_id)?.extract::<i64>().unwrap_or(i64::MAX))
}

/// The one row stride of a set of device layers: None where every layer is packed, else the
/// stride every (strided) layer shares, or SGLang's refusal (its transfers take one).
fn one_row_pitch(strided: &BTreeSet<u64>, packed: bool) -> PyResult<Option<u64>> {
    match (strided.len(), packed) {
        (0, _) => Ok(None),
        (1, false) => Ok(strided.first().copied()),
        _ => Err(not_implemented_err(format!(
            "HiCache: the device KV buffers do not share one row stride (strided rows {:?} B, \
             mixed with packed ones)",
            strided.iter().collect::<Vec<_>>()
        ))),
    }
}

/// SGLang 0.5.22+'s `_init_device_row_stride`: the bytes between the rows of `tensors` (device
/// layers) where they are strided views sharing one row stride, None where all are packed, or
/// a refusal (SGLang's where the strides differ). The rule is `check_all`'s (`strided_pitch`),
/// which reads each layer again, in full, at its first transfer.
#[pyfunction]
pub(super) fn device_row_pitch(
    py: Python<'_>,
    tensors: Vec<Bound<'_, PyAny>>,
) -> PyResult<Option<u64>> {
    let m = tensor_calls::methods(py)?;
    let (mut strided, mut packed) = (BTreeSet::new(), false);
    for (layer, tensor) in tensors.iter().enumerate() {
        if m.ask(&m.is_contiguous, tensor)?.is_truthy()? {
            packed = true;
            continue;
        }
        let shape: Vec<i64> = tensor.getattr(intern!(py, "shape"))?.extract()?;
        let element: i64 = m.ask(&m.element_size, tensor)?.extract()?;
        let what = format!("device layer {layer}");
        strided.insert(strided_pitch(m, tensor, &shape, element, &what)?);
    }
    one_row_pitch(&strided, packed)
}

/// The bytes from one row of a strided device layer (`shape`, in elements of `element` bytes)
/// to the next: each row (the dimensions after the first) packed, and rows no closer than their
/// bytes, or a refusal naming the tensor (`what`).
fn strided_pitch(
    m: &tensor_calls::Methods,
    tensor: &Bound<'_, PyAny>,
    shape: &[i64],
    element: i64,
    what: &str,
) -> PyResult<u64> {
    let strides: Vec<i64> = m.ask(&m.stride, tensor)?.extract()?;
    let mut inner = 1i128;
    for (&extent, &stride) in shape.iter().zip(&strides).skip(1).rev() {
        if extent > 1 && stride as i128 != inner {
            return Err(value_err(format!(
                "{what}: device layer tensors must be contiguous, or rows of contiguous \
                 elements a fixed stride apart (strides {strides:?} for shape {shape:?})"
            )));
        }
        inner *= extent as i128;
    }
    let (pitch, row_bytes) = (
        strides.first().map_or(0, |&s| s as i128) * element as i128,
        inner * element as i128,
    );
    // The core refuses such a pitch as well; here the refusal can name the tensor.
    if pitch < row_bytes || pitch > u64::MAX as i128 {
        return Err(value_err(format!(
            "{what}: device rows {pitch} bytes apart do not hold rows of {row_bytes} bytes"
        )));
    }
    Ok(pitch as u64)
}

/// A layer id as the Python int it stands for (whatever its type, so a refusal can show its
/// value), or the TypeError naming `layer_id` for a bool or a non-integer.
pub(super) fn layer_int<'py>(layer_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    args::py_int(layer_id, "layer_id")
}

fn py_tuple_text(values: &[i64]) -> String {
    match values {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            values
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl PyDeviceBinding {
    fn tensor(&self, plane: usize, position: usize) -> &Py<PyAny> {
        &self.tensors[plane * self.count + position]
    }

    fn nplanes(&self) -> usize {
        self.item_bytes.len()
    }

    /// Every tensor checked, as `check_device_layers` did in Python, with its texts.
    fn check_all(&self, py: Python<'_>) -> PyResult<CheckedDevice> {
        let t = torch(py)?;
        let m = tensor_calls::methods(py)?;
        let mut snaps = Vec::with_capacity(self.tensors.len());
        let mut rows: Vec<Option<i64>> = vec![None; self.count];
        let mut device: Option<Bound<'_, PyAny>> = None;
        let mut device_type = String::new();
        // First that they are tensors on one device (a property of the whole set), then each.
        for plane in 0..self.nplanes() {
            for layer in 0..self.count {
                let tensor = self.tensor(plane, layer).bind(py);
                let where_ = format!("{} plane {plane} layer {layer}", self.what);
                if !tensor.is_instance(t.tensor.bind(py))? {
                    return Err(type_err(format!(
                        "{where_}: expected a torch.Tensor, got {}",
                        tensor.get_type().name()?
                    )));
                }
                let dev = tensor.getattr("device")?;
                let dev_type: String = dev.getattr("type")?.extract()?;
                if dev_type != "cpu" && dev_type != "cuda" {
                    return Err(value_err(format!(
                        "{where_}: device pools must be on CPU or CUDA, got {}",
                        dev.str()?
                    )));
                }
                match &device {
                    None => {
                        device = Some(dev.clone());
                        device_type = dev_type.clone();
                    }
                    Some(first) if dev_type != device_type => {
                        return Err(value_err(format!(
                            "{where_}: device tensors mix {device_type} and {dev_type}"
                        )));
                    }
                    Some(first) if !first.eq(&dev)? => {
                        // One call runs on one GPU's stream; another GPU's layer is not its memory.
                        return Err(value_err(format!(
                            "{where_}: device tensors mix {} and {}",
                            first.str()?,
                            dev.str()?
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
        let (mut strided, mut packed) = (BTreeSet::new(), false);
        for plane in 0..self.nplanes() {
            for (layer, layer_rows) in rows.iter_mut().enumerate() {
                let tensor = self.tensor(plane, layer).bind(py);
                let where_ = format!("{} plane {plane} layer {layer}", self.what);
                let kind = tensor.get_type();
                if !kind.is(t.tensor.bind(py)) && !kind.is(t.parameter.bind(py)) {
                    // Its pointer and shape are what this binding writes through, and a
                    // subclass's own methods (or `__torch_function__`) could report memory it
                    // does not own.
                    return Err(type_err(format!(
                        "{where_}: expected a plain torch.Tensor, got the subclass {} (pass \
                         `t.as_subclass(torch.Tensor)`)",
                        kind.name()?
                    )));
                }
                let shape: Vec<i64> = tensor.getattr("shape")?.extract()?;
                if shape.is_empty() {
                    return Err(value_err(format!(
                        "{where_}: expected a tensor with a token dimension"
                    )));
                }
                // Strided rows (each row packed, rows further apart than its bytes) are what
                // SGLang's unified pools hand over: one layer's share of token-major entries.
                let contiguous = m.ask(&m.is_contiguous, tensor)?.is_truthy()?;
                if !contiguous && self.byte_rows.is_some() {
                    return Err(value_err(format!(
                        "{where_}: device layer tensors must be contiguous"
                    )));
                }
                if m.ask(&m.is_neg, tensor)?.is_truthy()?
                    || m.ask(&m.is_conj, tensor)?.is_truthy()?
                {
                    // Its stored values are not the ones it reads as: a copy of its bytes would
                    // move the un-negated (un-conjugated) values.
                    return Err(value_err(format!(
                        "{where_}: a negative or conjugate view cannot be a device layer \
                         (resolve it first: `t.resolve_neg()`, `t.resolve_conj()`)"
                    )));
                }
                // Our storage check asks the plain tensor, whose methods only torch answers.
                indices::check_storage(&indices::plain_tensor(tensor, "tensor")?, &where_)?;
                let element: i64 = m.ask(&m.element_size, tensor)?.extract()?;
                let want = self.item_bytes[plane];
                if let Some(units) = &self.byte_rows {
                    let nbytes = shape
                        .iter()
                        .fold(element as i128, |acc, &d| acc * d as i128);
                    // Whole units first: the bindings that read the same buffers as finer rows
                    // then agree on which rows exist (a call using two of them moves both or
                    // neither).
                    for unit in [units[plane], want] {
                        if nbytes % unit as i128 != 0 {
                            return Err(value_err(format!(
                                "{where_}: {nbytes} bytes are not whole rows of {unit} bytes"
                            )));
                        }
                    }
                    let count = (nbytes / want as i128) as i64;
                    *layer_rows = Some(layer_rows.map_or(count, |r| r.min(count)));
                    snaps.push(Snap::take(py, tensor, shape, false)?);
                    continue;
                }
                let row_bytes = shape[1..]
                    .iter()
                    .fold(element as i128, |acc, &d| acc * d as i128);
                if let Some(like) = self.like.get(plane) {
                    let dtype = tensor.getattr("dtype")?;
                    if !dtype.eq(like.dtype.bind(py))? {
                        return Err(value_err(format!(
                            "{where_}: dtype {} differs from the host pool's {}",
                            dtype.str()?,
                            like.dtype.bind(py).str()?
                        )));
                    }
                    if let Some((heads, dim)) = like.split {
                        if shape.len() == 3 && (shape[1], shape[2]) != (heads, dim) {
                            return Err(value_err(format!(
                                "{where_}: head split {} (heads, head_dim) differs from the host \
                                 pool's ({heads}, {dim})",
                                py_tuple_text(&shape[1..])
                            )));
                        }
                    }
                }
                if row_bytes != want as i128 {
                    return Err(value_err(format!(
                        "{where_}: device rows are {row_bytes} bytes but the host pool's item \
                         size is {want} bytes (dtype or head geometry differs from the host pool)"
                    )));
                }
                if contiguous {
                    packed = true;
                } else {
                    strided.insert(strided_pitch(m, tensor, &shape, element, &where_)?);
                }
                *layer_rows = Some(layer_rows.map_or(shape[0], |r| r.min(shape[0])));
                snaps.push(Snap::take(py, tensor, shape, !contiguous)?);
            }
        }
        let row_pitch = one_row_pitch(&strided, packed)?;
        let cuda = match (&device, device_type.as_str()) {
            (Some(dev), "cuda") => Some(dev.clone().unbind()),
            _ => None,
        };
        Ok(CheckedDevice {
            layout: extent::layout(py)?,
            snaps,
            rows: rows
                .into_iter()
                .map(|r| r.unwrap_or(0).max(0) as usize)
                .collect(),
            cuda,
            row_pitch,
        })
    }

    /// The row bound of a transfer touching `positions`.
    fn fewest_rows(checked: &CheckedDevice, positions: &[usize]) -> usize {
        positions
            .iter()
            .map(|&p| checked.rows[p])
            .min()
            .unwrap_or(0)
    }

    /// The binding's checked state for a call touching `positions`: the last check where every
    /// tensor it touches still holds, else a full check, which replaces it (then the third
    /// element is true: the check ran Python). The state it replaced is handed back, not
    /// dropped: dropping it may free a storage whose deleter runs Python, which must wait until
    /// the copy is done (the caller keeps it until then).
    fn checked(&self, py: Python<'_>, positions: &[usize]) -> PyResult<Checked> {
        let last = self.lock_checked(py)?.clone();
        let m = tensor_calls::methods(py)?;
        match last {
            Some(checked) if self.still_holds(py, &checked, positions)? => {
                Ok((checked, None, false))
            }
            last => {
                let fresh = Arc::new(m.unmoded(py, || self.check_all(py))?);
                let replaced = self.lock_checked(py)?.replace(Arc::clone(&fresh));
                drop(replaced); // the same state as `last`, which still holds it
                Ok((fresh, last, true))
            }
        }
    }

    /// The pointers of `positions` in `checked` (plane-major per position).
    fn ptrs_of(&self, checked: &CheckedDevice, positions: &[usize]) -> Vec<u64> {
        let mut out = Vec::with_capacity(positions.len() * self.nplanes());
        for plane in 0..self.nplanes() {
            for &pos in positions {
                out.push(checked.snaps[plane * self.count + pos].ptr);
            }
        }
        out
    }

    /// Whether every tensor at `positions` whose snapshot was read from torch's objects still
    /// has that extent, asked without running Python or making a Python object (so that no
    /// finalizer or hook can run while it is asked); and whether any tensor there was checked
    /// through Python instead (no torch layout), which this cannot ask.
    fn read_holds(&self, checked: &CheckedDevice, positions: &[usize]) -> (bool, bool) {
        let mut by_python = false;
        for plane in 0..self.nplanes() {
            for &pos in positions {
                match (
                    &checked.layout,
                    &checked.snaps[plane * self.count + pos].read,
                ) {
                    (Some(layout), Some(extent)) => {
                        // SAFETY: the snapshot was read through `layout`; the GIL is held (the
                        // caller's `Python` token is live); the binding holds the tensor and the
                        // snapshot its storage.
                        let unchanged = unsafe { layout.unchanged(extent) };
                        if !unchanged {
                            return (false, by_python);
                        }
                    }
                    _ => by_python = true,
                }
            }
        }
        (true, by_python)
    }

    fn still_holds(
        &self,
        py: Python<'_>,
        checked: &CheckedDevice,
        positions: &[usize],
    ) -> PyResult<bool> {
        // Read from torch's objects where the snapshot can be; the others are asked of Python
        // afterwards, with torch-function overrides off.
        let (held, by_python) = self.read_holds(checked, positions);
        if !held || !by_python {
            return Ok(held);
        }
        tensor_calls::methods(py)?.unmoded(py, || {
            for plane in 0..self.nplanes() {
                for &pos in positions {
                    let at = plane * self.count + pos;
                    let snap = &checked.snaps[at];
                    if snap.read.is_none()
                        && !snap.holds_by_python(py, self.tensors[at].bind(py))?
                    {
                        return Ok(false);
                    }
                }
            }
            Ok(true)
        })
    }

    fn lock_checked(
        &self,
        py: Python<'_>,
    ) -> PyResult<std::sync::MutexGuard<'_, Option<Arc<CheckedDevice>>>> {
        fork::lock(&self.checked, self.born, || self.lock_name()).map_err(|e| to_py(py, e))
    }

    fn lock_core(
        &self,
        py: Python<'_>,
    ) -> PyResult<std::sync::MutexGuard<'_, Option<Py<PyHostPool>>>> {
        fork::lock(&self.core, self.born, || self.lock_name()).map_err(|e| to_py(py, e))
    }

    fn lock_name(&self) -> String {
        format!("the device binding of {}", self.name)
    }

    /// The engine for the checked device and, for CUDA, the stream to queue on (torch's current
    /// stream of that device, read per call as SGLang does).
    fn engine(&self, py: Python<'_>, cuda: &Option<Py<PyAny>>, plan_only: bool) -> PyResult<Queue> {
        let mut queue = self.real_engine(py, cuda)?;
        if plan_only {
            queue.engine = engine::plan_only(queue.engine);
        }
        Ok(queue)
    }

    fn real_engine(&self, py: Python<'_>, cuda: &Option<Py<PyAny>>) -> PyResult<Queue> {
        match cuda {
            Some(device) => {
                let torch_stream = py
                    .import("torch.cuda")?
                    .call_method1("current_stream", (device.bind(py),))?;
                Ok(Queue {
                    engine: engine::for_cuda(),
                    stream: torch_stream.getattr("cuda_stream")?.extract()?,
                    torch_stream: Some(torch_stream.unbind()),
                })
            }
            None => Ok(Queue {
                engine: self.cpu_engine.clone().map_err(value_err)?,
                stream: 0,
                torch_stream: None,
            }),
        }
    }

    /// The engine backend for a transfer of `host` / `device` indices. SGLang 0.5.18-0.5.19
    /// translate DCP slots before they look at the io backend, so a refused backend with a run
    /// that is not whole widened pages fails on the run there: so it does here (only on that
    /// refusal's path, at no cost to a served call).
    fn transfer_backend(
        &self,
        py: Python<'_>,
        io_backend: &Bound<'_, PyAny>,
        host: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
    ) -> PyResult<Backend> {
        self.backend(py, io_backend).or_else(|refused| {
            if let IndexMap::Dcp { .. } = self.index_map {
                for indices in [host, device] {
                    // SGLang counts a tensor's elements (numel; an array's `size`), a
                    // sequence's entries.
                    let numel = indices
                        .call_method0(intern!(py, "numel"))
                        .and_then(|n| n.extract::<usize>())
                        .or_else(|_| indices.getattr(intern!(py, "size"))?.extract::<usize>());
                    if let Ok(n) = numel.or_else(|_| indices.len()) {
                        self.index_map.count(n).map_err(|e| to_py(py, e))?;
                    }
                }
            }
            Err(refused)
        })
    }

    fn backend(&self, py: Python<'_>, io_backend: &Bound<'_, PyAny>) -> PyResult<Backend> {
        let spec = &self.spec.get().spec;
        let result = match io_backend.cast::<PyString>() {
            Ok(text) => {
                let name = text.to_cow()?;
                spec.check_pair(Some(&name), &name)
            }
            Err(_) => spec.check_pair(None, &io_backend.str()?.to_cow()?),
        };
        result.map_err(|e| to_py(py, e))
    }

    fn live_core(&self, py: Python<'_>) -> PyResult<Py<PyHostPool>> {
        let core = self.lock_core(py)?;
        core.as_ref().map(|c| c.clone_ref(py)).ok_or_else(|| {
            runtime_err(format!(
                "{} has been destroyed; it cannot transfer",
                self.name
            ))
        })
    }

    /// One call's device pointers, row bound, engine and index arrays, in this order of reading:
    /// the indices first (converting one may run Python: a list's or an array's conversion, or
    /// any hook it calls, which could free or move a device layer), then the host memory and the
    /// device tensors, each of which may run Python too (a check through Python, or a finalizer
    /// or profile hook any Python call can trigger). So the call ends with a check that runs no
    /// Python and makes no Python object: every index tensor read in place and, where the checks
    /// ran Python (a full check), every touched device tensor and host storage read from torch's
    /// objects is still what this call checked; if not, everything is read again. The
    /// engine and where the indices are read depend on the device, which the last check stands
    /// in for until the tensors are checked (and the indices are read again in the rare case it
    /// changed).
    #[allow(clippy::too_many_arguments)]
    fn prepare<'py>(
        &self,
        py: Python<'py>,
        core: &PyHostPool,
        backend: Backend,
        positions: &[usize],
        host: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
        plan_only: bool,
    ) -> PyResult<Prepared<'py>> {
        let mut keep = Vec::new();
        let last = self.lock_checked(py)?.clone();
        let mut cuda = match &last {
            Some(checked) => checked.cuda.as_ref().map(|d| d.clone_ref(py)),
            None => {
                let (checked, replaced, _) = self.checked(py, positions)?;
                keep.extend(replaced);
                checked.cuda.as_ref().map(|d| d.clone_ref(py))
            }
        };
        keep.extend(last);
        for _ in 0..4 {
            let queue = self.engine(py, &cuda, plan_only)?;
            let indices = self.indices(py, backend, &queue, host, device)?;
            core.check_memory(py)?;
            let host_words = core.memory_words(py);
            let (checked, replaced, rechecked) = self.checked(py, positions)?;
            keep.extend(replaced);
            let same_device = match (&cuda, &checked.cuda) {
                (None, None) => true,
                (Some(a), Some(b)) => a.bind(py).eq(b.bind(py))?,
                _ => false,
            };
            if !same_device {
                cuda = checked.cuda.as_ref().map(|d| d.clone_ref(py));
                continue;
            }
            // No Python from here to the copy. A state that held (read from torch's objects, no
            // Python run since the host words were read) is settled as it stands.
            // (A tensor checked through Python counts as settled: the fallback cannot be asked
            // without running Python.)
            let settled = indices.settled(py)?
                && (!rechecked
                    || (self.read_holds(&checked, positions).0
                        && core.memory_words(py) == host_words));
            if settled {
                return Ok(Prepared {
                    ptrs: self.ptrs_of(&checked, positions),
                    rows: Self::fewest_rows(&checked, positions),
                    row_pitch: checked.row_pitch,
                    queue,
                    indices,
                    _keep: (checked, keep),
                });
            }
            keep.push(checked);
        }
        Err(runtime_err(format!(
            "{}: the device layers or the host memory kept changing while the call was prepared",
            self.what
        )))
    }

    /// Both index arrays in the form the core reads, for a call on `queue`.
    fn indices<'py>(
        &self,
        py: Python<'py>,
        backend: Backend,
        queue: &Queue,
        host: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
    ) -> PyResult<Indices<'py>> {
        // CPU device pools and the direct backend read indices on the host; a CUDA kernel reads
        // device-resident ones where they are (and bounds-checks them itself).
        let host_side =
            !(queue.engine.memory() == DeviceMemory::Cuda && backend == Backend::Kernel);
        let (mut h, h_keep, h_witness) = index_array(py, host, host_side)?;
        let (mut d, d_keep, d_witness) = index_array(py, device, host_side)?;
        (h.map, d.map) = (self.index_map, self.index_map);
        // A kernel reads device-resident indices in place, after this call returns: tell torch's
        // caching allocator, so a caller freeing them on another stream cannot have their
        // memory reused before the kernel has read them. Recorded before the call, since a call
        // that fails may still have queued work reading them (recording early only delays
        // reuse).
        if let Some(torch_stream) = &queue.torch_stream {
            for (on_device, value, keep) in
                [(h.on_device, host, &h_keep), (d.on_device, device, &d_keep)]
            {
                if on_device {
                    let tensor = keep.as_ref().unwrap_or(value);
                    tensor.call_method1(
                        pyo3::intern!(py, "record_stream"),
                        (torch_stream.bind(py),),
                    )?;
                }
            }
        }
        Ok(Indices {
            h,
            d,
            witnesses: [h_witness, d_witness],
            _keep: [h_keep, d_keep],
        })
    }

    /// Runs one core call over `ptrs` (read after everything that may run Python).
    fn run(
        &self,
        py: Python<'_>,
        core: &PyHostPool,
        backend: Backend,
        op: Op,
        ptrs: Vec<u64>,
        call: &Prepared<'_>,
    ) -> PyResult<()> {
        let (engine, stream) = (call.queue.engine, call.queue.stream);
        // SAFETY: `ptrs` are the `data_ptr()`s of device tensors this binding holds (so they
        // stay alive for the call), checked in this call to be contiguous (or rows `row_pitch`
        // apart, each packed), on `engine`'s device, with storage for at least `rows` rows of
        // each plane's item size at that pitch (`storage_holds` of their shape), and the plane
        // memory was checked in this call, with no Python run since (`prepare`); the index
        // arrays come from live contiguous int32/int64 tensors held by `call` or the caller's
        // arguments.
        // CUDA work is queued on the device's current stream, in whose order torch's caching
        // allocator reuses freed memory.
        unsafe {
            core.run_checked(
                py,
                backend,
                op,
                ptrs,
                call.rows,
                call.row_pitch,
                call.indices.h,
                call.indices.d,
                engine,
                stream,
                self.view.as_ref(),
            )
        }
    }
}

/// A call's index arrays and the converted tensors they read, kept alive for the call.
struct Indices<'py> {
    h: IndexArray,
    d: IndexArray,
    /// What was read in place from torch's objects (None: read through Python).
    witnesses: [Option<IndexWitness>; 2],
    _keep: [Option<Bound<'py, PyAny>>; 2],
}

impl Indices<'_> {
    /// Whether each index tensor read in place still has what was read (no Python run: the
    /// layout was found when the indices were read).
    fn settled(&self, py: Python<'_>) -> PyResult<bool> {
        let Some(layout) = extent::layout(py)? else {
            return Ok(true); // nothing was read in place
        };
        // SAFETY: the GIL is held (`py`); the witnesses were read through this layout; each
        // object is the caller's argument, borrowed for the call, or a conversion `_keep` holds.
        Ok(self
            .witnesses
            .iter()
            .flatten()
            .all(|w| unsafe { w.holds(&layout) }))
    }
}

/// `PyDeviceBinding::checked`'s answer: the state, the one it replaced, whether it checked anew.
type Checked = (Arc<CheckedDevice>, Option<Arc<CheckedDevice>>, bool);

/// A call ready to run: see `PyDeviceBinding::prepare`.
struct Prepared<'py> {
    ptrs: Vec<u64>,
    rows: usize,
    row_pitch: Option<u64>,
    queue: Queue,
    indices: Indices<'py>,
    /// The checked state the pointers come from, and every state this call replaced: dropped
    /// with the call, after its copy (dropping one may free a storage and run Python).
    _keep: (Arc<CheckedDevice>, Vec<Arc<CheckedDevice>>),
}

/// An index argument as the core reads it: the fast path reads a contiguous 1-D int32/int64
/// tensor in place (checking that its storage holds it); everything else goes through
/// `as_index_array`, whose result the caller keeps alive (the second element). The third is
/// what was read from torch's objects, for the call's last check.
fn index_array<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    host_side: bool,
) -> PyResult<(IndexArray, Option<Bound<'py, PyAny>>, Option<IndexWitness>)> {
    let t = torch(py)?;
    if let Some((array, witness)) = fast_index(py, t, value, host_side)? {
        return Ok((array, None, witness));
    }
    let target = host_side.then(|| t.cpu.bind(py).clone());
    let m = tensor_calls::methods(py)?;
    let converted = m.unmoded(py, || indices::as_index_array(value, target.as_ref()))?;
    // The conversion is a contiguous 1-D int32/int64 tensor: read like any other, from torch's
    // objects where they can be read.
    if let Some((array, witness)) = fast_index(py, t, &converted, host_side)? {
        return Ok((array, Some(converted), witness));
    }
    let (ptr, len, element, on_device) = m.unmoded(py, || {
        Ok((
            m.ask(&m.data_ptr, &converted)?.extract::<u64>()?,
            m.ask(&m.numel, &converted)?.extract::<usize>()?,
            m.ask(&m.element_size, &converted)?.extract::<usize>()?,
            converted.getattr("is_cuda")?.extract::<bool>()?,
        ))
    })?;
    let width = match element {
        4 => IndexWidth::I32,
        _ => IndexWidth::I64,
    };
    Ok((
        IndexArray {
            ptr,
            len,
            width,
            on_device,
            map: crate::request::IndexMap::Identity,
        },
        Some(converted),
        None,
    ))
}

/// An index tensor read in place from torch's objects, and what was read: a call compares it
/// again in its last check, since Python run after the read (another argument's conversion, a
/// finalizer) could have freed or moved it.
pub(super) struct IndexWitness {
    object: usize,
    dense: extent::Dense,
}

impl IndexWitness {
    /// Whether the tensor still has what was read through `layout`, asked without running
    /// Python.
    ///
    /// # Safety
    /// The GIL is held, `layout` is the one it was read through, and the tensor object read is
    /// still alive (the caller's argument, or a conversion the call keeps).
    unsafe fn holds(&self, layout: &extent::TorchLayout) -> bool {
        // SAFETY: this function's contract is `dense`'s (the object is exactly a torch.Tensor:
        // only such objects are read in place).
        let now = unsafe { layout.dense(self.object) };
        now == Some(self.dense)
    }
}

/// An index argument as a tensor the core reads, and its length: the argument itself where it
/// already is one (a contiguous 1-D int32/int64 tensor, on the host when `host_side`), else
/// `as_index_array`'s conversion (on the host when `host_side`, else where it is).
pub(super) fn index_tensor<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    host_side: bool,
) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let t = torch(py)?;
    if let Some((array, _)) = fast_index(py, t, value, host_side)? {
        return Ok((value.clone(), array.len));
    }
    let target = host_side.then(|| t.cpu.bind(py).clone());
    let m = tensor_calls::methods(py)?;
    m.unmoded(py, || {
        let converted = indices::as_index_array(value, target.as_ref())?;
        let len = m.ask(&m.numel, &converted)?.extract()?;
        Ok((converted, len))
    })
}

/// The values of an index argument, read on the host (the page digests' slots).
fn index_values(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let t = torch(py)?;
    let array = indices::as_index_array(value, Some(t.cpu.bind(py)))?;
    array.call_method0("tolist")?.extract()
}

pub(super) fn fast_index(
    py: Python<'_>,
    t: &Torch,
    value: &Bound<'_, PyAny>,
    host_side: bool,
) -> PyResult<Option<(IndexArray, Option<IndexWitness>)>> {
    // A subclass could report an address or a shape its storage does not have (through its
    // own methods or `__torch_function__`): the conversion reads it as a plain tensor first.
    if !value.get_type().is(t.tensor.bind(py)) {
        return Ok(None);
    }
    let layout = extent::layout(py)?;
    // SAFETY: `value` is exactly a torch.Tensor (checked above), borrowed for this call, and
    // the GIL is held.
    if let Some(facts) = layout.and_then(|l| unsafe { l.index(value.as_ptr() as usize) }) {
        // Anything else (another dtype, device-resident host indices) takes the path below,
        // which hands it to the conversion with its refusals.
        let width = match facts.scalar_type {
            SCALAR_INT64 => Some(IndexWidth::I64),
            SCALAR_INT32 => Some(IndexWidth::I32),
            _ => None,
        };
        if let Some(width) = width.filter(|_| !(facts.on_device && host_side)) {
            let array = dense_index(py, value, width, facts.on_device, facts.dense)?;
            return Ok(Some((array, Some(witness(value, facts.dense)))));
        }
    }
    let dtype = value.getattr(pyo3::intern!(py, "dtype"))?;
    let width = if dtype.is(t.int64.bind(py)) {
        IndexWidth::I64
    } else if dtype.is(t.int32.bind(py)) {
        IndexWidth::I32
    } else {
        return Ok(None);
    };
    let m = tensor_calls::methods(py)?;
    let dim: usize = m.ask(&m.dim, value)?.extract()?;
    if dim != 1 {
        return Ok(None);
    }
    let on_device = value.getattr(pyo3::intern!(py, "is_cuda"))?.is_truthy()?;
    if on_device && host_side {
        return Ok(None);
    }
    if !on_device && !value.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()? {
        return Ok(None); // meta and other devices: as_index_array refuses them with its text
    }
    if !m.ask(&m.is_contiguous, value)?.is_truthy()? || m.ask(&m.is_neg, value)?.is_truthy()? {
        return Ok(None); // a negative view: as_index_array resolves it
    }
    let (dense, witnessed) = match layout {
        // SAFETY: `value` is exactly a torch.Tensor on a CPU or CUDA device (checked above),
        // borrowed for this call, and the GIL is held.
        Some(layout) => match unsafe { layout.dense(value.as_ptr() as usize) } {
            Some(dense) => (dense, Some(witness(value, dense))),
            None => return Ok(None),
        },
        None => (m.unmoded(py, || python_dense(py, value))?, None),
    };
    let array = dense_index(py, value, width, on_device, dense)?;
    Ok(Some((array, witnessed)))
}

fn witness(value: &Bound<'_, PyAny>, dense: extent::Dense) -> IndexWitness {
    IndexWitness {
        object: value.as_ptr() as usize,
        dense,
    }
}

// c10 ScalarType numbers of the index dtypes: a TensorImpl holds its dtype as a TypeMeta index,
// which equals the ScalarType number for every scalar type.
const SCALAR_INT64: u16 = 4;
const SCALAR_INT32: u16 = 3;

/// A checked dense index tensor as the core reads it.
fn dense_index(
    py: Python<'_>,
    value: &Bound<'_, PyAny>,
    width: IndexWidth,
    on_device: bool,
    dense: extent::Dense,
) -> PyResult<IndexArray> {
    let len = dense.numel as usize;
    let need = (dense.storage_offset as u128 + len as u128) * width.bytes() as u128;
    // A storage shorter than the view, or without memory (functionalized, fake): check_storage
    // refuses it with its text.
    if len > 0 && (need > dense.storage_nbytes as u128 || dense.storage_data == 0) {
        let m = tensor_calls::methods(py)?;
        m.unmoded(py, || {
            indices::check_storage(&indices::plain_tensor(value, "tensor")?, "index tensor")
        })?;
        // What torch's objects said is what is read: never past it, whatever Python said.
        return Err(value_err(format!(
            "index tensor: its storage holds {} bytes, fewer than the {need} its {len} values \
             at offset {} need",
            dense.storage_nbytes, dense.storage_offset
        )));
    }
    let ptr = dense.storage_data as u128 + dense.storage_offset as u128 * width.bytes() as u128;
    Ok(IndexArray {
        ptr: ptr as u64,
        len,
        width,
        on_device,
        map: crate::request::IndexMap::Identity,
    })
}

/// An index tensor's extent asked of torch through Python (the path without torch's field
/// offsets): a storage whose address torch will not give (functionalized) reads as no data.
fn python_dense(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<extent::Dense> {
    let m = tensor_calls::methods(py)?;
    let numel: u64 = m.ask(&m.numel, value)?.extract()?;
    if numel == 0 {
        return Ok(extent::Dense {
            numel,
            storage_offset: 0,
            storage_data: 0,
            storage_nbytes: 0,
        });
    }
    let storage = m.ask(&m.untyped_storage, value)?;
    Ok(extent::Dense {
        numel,
        storage_offset: m.ask(&m.storage_offset, value)?.extract()?,
        storage_data: m
            .ask(&m.storage_data_ptr, &storage)
            .and_then(|p| p.extract::<u64>())
            .unwrap_or(0),
        storage_nbytes: m.ask(&m.storage_nbytes, &storage)?.extract()?,
    })
}

/// The layers at `positions` of each plane's full layer list; a position one plane lacks is
/// refused naming the shortest plane's layer count.
fn pick_layers(
    py: Python<'_>,
    planes: Vec<Vec<Py<PyAny>>>,
    positions: &[i64],
) -> crate::Result<Vec<Vec<Py<PyAny>>>> {
    let layers = planes.iter().map(Vec::len).min().unwrap_or(0);
    let mut picked = Vec::with_capacity(planes.len());
    for plane in &planes {
        let mut held = Vec::with_capacity(positions.len());
        for &layer in positions {
            let tensor = usize::try_from(layer)
                .ok()
                .and_then(|i| plane.get(i))
                .ok_or(PlanError::DeviceLayerOutOfRange { layer, layers })?;
            held.push(tensor.clone_ref(py));
        }
        picked.push(held);
    }
    Ok(picked)
}

#[pymethods]
impl PyDeviceBinding {
    /// `planes`: per plane, the device layer tensors (owned target layers in host order, then
    /// one per packed draft). `like`: per plane, `(dtype, (heads, head_dim) or None)`.
    #[new]
    /// `positions`: when given, `planes` holds every layer of a device pool handed to one call,
    /// and the binding holds the layers at these positions of each (a position the device
    /// pool lacks is a `LayerIndexError`). `packed`: (plane name, layers) of SGLang's packed
    /// target + MTP draft device tables, which a backup needs one host layer each of.
    /// `host_planes`: the pool's planes the binding moves, in `planes`' order (None: all).
    /// `byte_rows`: per plane, a unit of bytes; each device tensor is then its bytes (any
    /// contiguous shape and dtype), whole units of them, in rows of the item size, not a first
    /// dimension of such rows.
    #[pyo3(signature = (pool, planes, owned_slots, device_layer_num, target_layer_num, *, host_layers = None, like = Vec::new(), what = "device pool", name = "host pool", index_map = None, positions = None, packed = None, host_planes = None, byte_rows = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        pool: Py<PyHostPool>,
        planes: Vec<Vec<Py<PyAny>>>,
        owned_slots: Vec<i64>,
        device_layer_num: i64,
        target_layer_num: usize,
        host_layers: Option<Vec<usize>>,
        like: Vec<LikeArg>,
        what: &str,
        name: &str,
        index_map: Option<&Bound<'_, PyAny>>,
        positions: Option<Vec<i64>>,
        packed: Option<(String, usize)>,
        host_planes: Option<Vec<usize>>,
        byte_rows: Option<Vec<u64>>,
    ) -> PyResult<Self> {
        let index_map = args::index_map(index_map)?;
        let planes = match positions {
            Some(positions) => pick_layers(py, planes, &positions).map_err(|e| to_py(py, e))?,
            None => planes,
        };
        // Device rows are checked against the rows the binding addresses: the pool's (or the
        // planes it moves), or the V4 pool's finer C4 token rows over the same bytes (its index
        // map says which).
        let host = pool.get();
        let moved = host
            .plane_view(host_planes.as_deref())
            .map_err(|e| to_py(py, e))?;
        let view = match PyHostPool::row_view(&moved, index_map).map_err(|e| to_py(py, e))? {
            Some(rows) => Some(rows),
            None => host_planes.is_some().then_some(moved),
        };
        let rows_of = view.as_ref().unwrap_or(&host.geom);
        let item_bytes: Vec<u64> = rows_of.item_bytes.iter().map(|&b| b as u64).collect();
        let spec = host.spec.as_ref().map(|s| s.clone_ref(py)).ok_or_else(|| {
            value_err(format!(
                "{what}: the host pool has no PoolSpec to check (layout, io_backend) pairs by"
            ))
        })?;
        if planes.len() != item_bytes.len() {
            return Err(value_err(format!(
                "{what}: {} planes of device layers for a host pool of {}",
                planes.len(),
                item_bytes.len()
            )));
        }
        if let Some(units) = &byte_rows {
            if units.len() != planes.len() || units.contains(&0) {
                return Err(value_err(format!(
                    "{what}: byte_rows needs one positive unit per plane, got {units:?}"
                )));
            }
        }
        let count = planes.first().map_or(0, Vec::len);
        if planes.iter().any(|p| p.len() != count) {
            return Err(value_err(format!(
                "{what}: every plane needs one tensor per owned layer and draft"
            )));
        }
        let layers = LayerMap::new(
            count,
            &owned_slots,
            device_layer_num,
            target_layer_num,
            host_layers.as_deref(),
            what,
        )
        .map_err(|e| to_py(py, e))?;
        let tensors: Vec<Py<PyAny>> = planes.into_iter().flatten().collect();
        let like = like
            .into_iter()
            .map(|(dtype, split)| Like { dtype, split })
            .collect();
        Ok(Self {
            core: Mutex::new(Some(pool)),
            spec,
            name: name.to_owned(),
            what: what.to_owned(),
            tensors,
            count,
            item_bytes,
            like,
            byte_rows,
            layers,
            cpu_engine: config::cpu_engine().map(engine::for_cpu),
            checked: Mutex::new(None),
            index_map,
            packed,
            born: fork::generation(),
            view,
        })
    }

    /// Host layer `layer_id` (a controller id) -> its device layer. False, with nothing read,
    /// for a target layer this pool does not hold (SGLang returns without copying); a draft id
    /// outside the packed drafts is refused.
    /// `plan_only`: check and plan the call as it would run, and move nothing.
    #[pyo3(signature = (layer_id, host_indices, device_indices, io_backend, is_draft = false, *, plan_only = false))]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn load(
        &self,
        py: Python<'_>,
        layer_id: &Bound<'_, PyAny>,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        io_backend: &Bound<'_, PyAny>,
        is_draft: bool,
        plan_only: bool,
    ) -> PyResult<bool> {
        let Some((host_layer, position)) = self.lookup_entry(py, layer_id, is_draft)? else {
            return Ok(false);
        };
        let backend = self.transfer_backend(py, io_backend, host_indices, device_indices)?;
        let core = self.live_core(py)?;
        if !plan_only {
            let rows = || self.host_rows(py, host_indices);
            core.get()
                .verify_pages(py, &self.name, host_indices, rows)?;
        }
        let mut call = self.prepare(
            py,
            core.get(),
            backend,
            &[position],
            host_indices,
            device_indices,
            plan_only,
        )?;
        let ptrs = std::mem::take(&mut call.ptrs);
        self.run(
            py,
            core.get(),
            backend,
            Op::Load { host_layer },
            ptrs,
            &call,
        )?;
        Ok(true)
    }

    /// Every held device layer -> host: one core call when every host layer has a device
    /// layer, else one per held layer (they share the indices, so the first call's validation,
    /// which precedes its first byte, covers them all).
    #[pyo3(signature = (host_indices, device_indices, io_backend, *, plan_only = false))]
    pub(super) fn backup(
        &self,
        py: Python<'_>,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        io_backend: &Bound<'_, PyAny>,
        plan_only: bool,
    ) -> PyResult<()> {
        let backend = self.transfer_backend(py, io_backend, host_indices, device_indices)?;
        let core = self.live_core(py)?;
        if let Some((name, layers)) = &self.packed {
            let host = self.layers.host_layer_num();
            if *layers != host {
                // SGLang backs up every packed device layer into its own host layer: a draft
                // pool of more than one layer has no host layer to land in.
                return Err(to_py(
                    py,
                    Error::transfer(format!(
                        "packed target + MTP draft device pools {name} has {layers} layers but \
                         the host pool holds {host}"
                    )),
                ));
            }
        }
        let order = self.layers.backup_order();
        if order.is_empty() {
            return Ok(());
        }
        let positions: Vec<usize> = order.iter().map(|&(_, p)| p).collect();
        let mut call = self.prepare(
            py,
            core.get(),
            backend,
            &positions,
            host_indices,
            device_indices,
            plan_only,
        )?;
        let ptrs = std::mem::take(&mut call.ptrs);
        if self.layers.complete() {
            self.run(py, core.get(), backend, Op::Backup, ptrs, &call)?;
        } else {
            let n = positions.len();
            for (k, &(host_layer, _)) in order.iter().enumerate() {
                let layer_ptrs = (0..self.nplanes()).map(|p| ptrs[p * n + k]).collect();
                self.run(
                    py,
                    core.get(),
                    backend,
                    Op::BackupLayer { host_layer },
                    layer_ptrs,
                    &call,
                )?;
            }
        }
        if core.get().watches() && !plan_only {
            if let Some(stream) = &call.queue.torch_stream {
                stream.bind(py).call_method0("synchronize")?; // the copy has landed
            }
            core.get()
                .record_pages(py, &self.host_rows(py, host_indices)?)?;
        }
        Ok(())
    }

    /// The host layer of controller layer `layer_id`, or None for a target layer this pool
    /// does not hold.
    #[pyo3(signature = (layer_id, is_draft = false))]
    fn lookup(
        &self,
        py: Python<'_>,
        layer_id: &Bound<'_, PyAny>,
        is_draft: bool,
    ) -> PyResult<Option<usize>> {
        Ok(self
            .lookup_entry(py, layer_id, is_draft)?
            .map(|(host, _)| host))
    }

    /// `(controller layer id, host layer)` of every owned target layer, by host layer.
    #[getter]
    fn targets(&self) -> Vec<(i64, usize)> {
        self.layers.targets()
    }

    #[getter]
    fn host_layer_num(&self) -> usize {
        self.layers.host_layer_num()
    }

    /// Whether every host layer has a device layer (one all-layer core call backs up all).
    #[getter]
    fn complete(&self) -> bool {
        self.layers.complete()
    }

    /// The device of the first device tensor (unchecked; `torch.device("cpu")` without any).
    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self.tensors.first() {
            Some(t) => match t.bind(py).getattr("device") {
                Ok(d) => Ok(d.unbind()),
                Err(_) => Ok(torch(py)?.cpu.clone_ref(py)),
            },
            None => Ok(torch(py)?.cpu.clone_ref(py)),
        }
    }

    /// Drops the core (the pool was destroyed): later transfers raise.
    pub(super) fn release(&self, py: Python<'_>) -> PyResult<()> {
        let core = self.lock_core(py)?.take();
        drop(core); // after the lock is released: the last reference may run Python finalizers
        Ok(())
    }
}

impl PyDeviceBinding {
    /// The host rows a transfer of `host_indices` moves (the values read through the binding's
    /// index map: under DCP, this rank's share of the logical slots), read on the host for
    /// the page digests.
    fn host_rows(&self, py: Python<'_>, host_indices: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        let raw = index_values(py, host_indices)?;
        self.index_map.apply_all(&raw).map_err(|e| to_py(py, e))
    }

    fn lookup_entry(
        &self,
        py: Python<'_>,
        layer_id: &Bound<'_, PyAny>,
        is_draft: bool,
    ) -> PyResult<Option<(usize, usize)>> {
        let key = layer_key(layer_id)?;
        self.layers.lookup(key, is_draft).map_err(|e| to_py(py, e))
    }
}
