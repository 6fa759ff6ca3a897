//! Tensor and storage methods asked through their types, never through the object.
//!
//! A torch tensor has an instance `__dict__`, and torch keeps one Python object per storage, so
//! a storage has one too: an attribute set there shadows a method of the same name
//! (`t.data_ptr = lambda: addr` makes `t.data_ptr()` answer anything). Every fact the core reads
//! or writes through (an address, an extent, contiguity) is therefore asked of the type's own
//! method, `torch.Tensor.data_ptr(t)`, which only torch answers. Properties (`shape`, `device`,
//! `dtype`, `nbytes`) are data descriptors, which an instance attribute cannot shadow, so they
//! are read as attributes. A subclass can still override the type's methods; the callers refuse
//! subclasses or read them as a plain alias (`indices::plain_tensor`). And an
//! active torch-function mode (a `TorchFunctionMode` the caller entered) is asked before the
//! type's method itself, so the checks that ask Python run with every torch-function override
//! off (`unmoded`).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

pub(crate) struct Methods {
    pub(crate) data_ptr: Py<PyAny>,
    pub(crate) untyped_storage: Py<PyAny>,
    pub(crate) storage_offset: Py<PyAny>,
    pub(crate) numel: Py<PyAny>,
    pub(crate) element_size: Py<PyAny>,
    pub(crate) is_contiguous: Py<PyAny>,
    pub(crate) dim: Py<PyAny>,
    pub(crate) is_neg: Py<PyAny>,
    pub(crate) is_conj: Py<PyAny>,
    pub(crate) stride: Py<PyAny>,
    /// `torch.UntypedStorage`'s (C) methods.
    pub(crate) storage_data_ptr: Py<PyAny>,
    pub(crate) storage_nbytes: Py<PyAny>,
    /// `torch._C.DisableTorchFunction`: subclasses' and modes' overrides off while entered.
    overrides_off: Py<PyAny>,
}

static METHODS: PyOnceLock<Methods> = PyOnceLock::new();

pub(crate) fn methods(py: Python<'_>) -> PyResult<&Methods> {
    METHODS.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let tensor = torch.getattr("Tensor")?;
        let storage = torch.getattr("UntypedStorage")?;
        let of = |owner: &Bound<'_, PyAny>, name: &str| -> PyResult<Py<PyAny>> {
            Ok(owner.getattr(name)?.unbind())
        };
        Ok(Methods {
            data_ptr: of(&tensor, "data_ptr")?,
            untyped_storage: of(&tensor, "untyped_storage")?,
            storage_offset: of(&tensor, "storage_offset")?,
            numel: of(&tensor, "numel")?,
            element_size: of(&tensor, "element_size")?,
            is_contiguous: of(&tensor, "is_contiguous")?,
            dim: of(&tensor, "dim")?,
            is_neg: of(&tensor, "is_neg")?,
            is_conj: of(&tensor, "is_conj")?,
            stride: of(&tensor, "stride")?,
            storage_data_ptr: of(&storage, "data_ptr")?,
            storage_nbytes: of(&storage, "nbytes")?,
            overrides_off: torch
                .getattr("_C")?
                .getattr("DisableTorchFunction")?
                .unbind(),
        })
    })
}

impl Methods {
    /// `f()` with every torch-function override off (subclasses' and modes'), so that what torch
    /// is asked inside is answered by torch.
    pub(crate) fn unmoded<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce() -> PyResult<R>,
    ) -> PyResult<R> {
        let guard = self.overrides_off.bind(py).call0()?;
        guard.call_method0("__enter__")?;
        let result = f();
        let none = py.None();
        guard.call_method1("__exit__", (&none, &none, &none))?;
        result
    }

    /// `method(obj)`: the type's method called with `obj`.
    pub(crate) fn ask<'py>(
        &self,
        method: &Py<PyAny>,
        obj: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        method.bind(obj.py()).call1((obj,))
    }
}
