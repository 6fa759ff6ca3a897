//! `_core.V4Transfers`: what a DeepSeek V4 paged pool's transfers check and which device
//! binding moves them, in SGLang's order of refusals.
//!
//! A V4 call names slots. Whole slot pages move as page rows (one binding; kernel_ascend's over
//! the page rows and the scale rows together once scales are attached); any other count is
//! SGLang's token-granular path, which moves each token's C4 value and scale through two
//! bindings over the same bytes read as rows of one value and rows of one scale. Everything that
//! can be refused is refused before a byte moves: the indices, the device buffers, the page
//! alignment, the (layout, io_backend) pair, the layer, then the bindings' own checks.

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::binding::{index_tensor, layer_int, PyDeviceBinding};
use super::errors::{to_py, value_err};
use super::indices;
use super::spec::PyPoolSpec;
use crate::error::PlanError;
use crate::pool::c4;

/// Which layers a call moves: every one (a backup), or one load layer (read once, by
/// `checked_layers`, so that every binding the call runs moves the same layer).
enum Layers<'py> {
    All,
    One(Bound<'py, PyAny>),
}

#[pyclass(frozen, module = "hostkv_rs._core", name = "V4Transfers")]
pub struct PyV4Transfers {
    name: String,
    /// Tokens per page row (`slot_page_size`) and bytes per row (`item_bytes`).
    page_size: usize,
    item_bytes: u64,
    /// The pool's geometry; None for a pool made with `__new__` and a few attributes set by
    /// hand, as SGLang's own unit tests make them (only the page-alignment refusal applies).
    spec: Option<Py<PyPoolSpec>>,
    page: Option<Py<PyDeviceBinding>>,
    /// The page rows and scale rows together (kernel_ascend, with scales attached).
    ascend: Option<Py<PyDeviceBinding>>,
    /// The C4 value rows and scale rows (layer_first C4 pools).
    tokens: Option<(Py<PyDeviceBinding>, Py<PyDeviceBinding>)>,
    /// Why the device buffers cannot be moved as rows (refused by every transfer).
    refusal: Option<String>,
    /// The device buffers' `torch.device`, and its type (`"cpu"`, `"cuda"`, ...).
    device: Py<PyAny>,
    device_type: String,
    /// Whether the pool holds page rows (a pool of no pages holds none).
    has_rows: bool,
}

/// Both index tensors of a call and their length.
type Pair<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>, usize);

impl PyV4Transfers {
    /// Both index arguments as tensors, or None when there is nothing to move.
    fn indices<'py>(
        &self,
        host: &Bound<'py, PyAny>,
        device: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Pair<'py>>> {
        let py = host.py();
        if host.is_none() || device.is_none() {
            return Ok(None);
        }
        let (host, n) = index_tensor(py, host, false)?;
        let (device, m) = index_tensor(py, device, false)?;
        if n != m {
            let mismatch = PlanError::LengthMismatch {
                host: n,
                device: m,
                pool: Some(self.name.clone()),
            };
            return Err(to_py(py, mismatch.into()));
        }
        Ok((n > 0).then_some((host, device, n)))
    }

    fn unaligned(&self, py: Python<'_>, n: usize) -> PyErr {
        let partial = PlanError::PartialPage {
            len: n,
            page_size: self.page_size,
            pool: Some(self.name.clone()),
        };
        to_py(py, partial.into())
    }

    /// The refusals every transfer makes first: device buffers that are not rows, a partial
    /// page where only whole ones are allowed (`aligned` false: the pool is page-aligned-only and
    /// the call names a partial page), a device the engines cannot address.
    fn check_device(&self, py: Python<'_>, aligned: bool, n: usize) -> PyResult<()> {
        if let Some(refusal) = &self.refusal {
            return Err(value_err(format!("{} transfer: {refusal}", self.name)));
        }
        if !aligned {
            return Err(self.unaligned(py, n));
        }
        if self.device_type != "cpu" && self.device_type != "cuda" {
            // The copy engines address CPU or CUDA memory only (a meta tensor has no bytes).
            return Err(value_err(format!(
                "{}: device buffers must be on CPU or CUDA to transfer, got {}",
                self.name,
                self.device.bind(py).str()?
            )));
        }
        Ok(())
    }

    fn spec(&self) -> PyResult<&PyPoolSpec> {
        match &self.spec {
            Some(spec) => Ok(spec.get()),
            None => Err(self.no_rows()),
        }
    }

    fn no_rows(&self) -> PyErr {
        value_err(format!(
            "{} transfer: the host pool has no page rows (it has no pages, or was built \
             without its constructor and holds no device side)",
            self.name
        ))
    }

    /// The support table's backend for `io_backend` (as a string the bindings take).
    fn backend<'py>(
        &self,
        py: Python<'py>,
        io_backend: &Bound<'py, PyAny>,
        transfer: &str,
    ) -> PyResult<Bound<'py, PyString>> {
        let name = self.spec()?.check_pair(py, io_backend, transfer)?;
        Ok(PyString::new(py, name))
    }

    /// `layers` with a load's layer id read as an int once and checked, or None where there is
    /// no layer to move (a backup of a pool without layers).
    fn checked_layers<'py>(
        &self,
        py: Python<'_>,
        layers: Layers<'py>,
    ) -> PyResult<Option<Layers<'py>>> {
        match layers {
            Layers::All => Ok((self.spec()?.spec.layers > 0).then_some(Layers::All)),
            Layers::One(layer_id) => {
                let layer = layer_int(&layer_id)?;
                self.spec()?.layer(py, &layer)?;
                Ok(Some(Layers::One(layer)))
            }
        }
    }

    /// One binding's call.
    fn run(
        binding: &PyDeviceBinding,
        layers: &Layers<'_>,
        host: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
        backend: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = host.py();
        match layers {
            Layers::All => binding.backup(py, host, device, backend, false),
            Layers::One(layer_id) => binding
                .load(py, layer_id, host, device, backend, false, false)
                .map(drop),
        }
    }

    /// SGLang's `transfer_cache_dsv4_mla`: per token, its value and scale segments of the C4
    /// page row, whatever the io_backend.
    fn tokens(
        &self,
        py: Python<'_>,
        io_backend: &str,
        backend: &Bound<'_, PyAny>,
        pair: (Bound<'_, PyAny>, Bound<'_, PyAny>),
        layers: Layers<'_>,
    ) -> PyResult<()> {
        let layers = self.checked_layers(py, layers)?;
        let Some((values, scales)) = &self.tokens else {
            if !self.has_rows {
                return if layers.is_some() {
                    Err(self.no_rows())
                } else {
                    Ok(())
                };
            }
            return Err(value_err(format!(
                "{} token-granular transfers need the DSV4 C4 page row (slot_page_size={}, \
                 item_bytes={}), got slot_page_size={}, item_bytes={}",
                self.name,
                c4::PAGE_TOKENS,
                c4::ROW_BYTES,
                self.page_size,
                self.item_bytes
            )));
        };
        let Some(layers) = layers else {
            return Ok(());
        };
        if !self.has_rows {
            return Err(self.no_rows());
        }
        // The copy engine plans direct copies on the host; kernels read indices on the GPU.
        let (host, dev) = if self.device_type == "cuda" && io_backend == "kernel" {
            let device = self.device.bind(py);
            (
                indices::as_index_array(&pair.0, Some(device))?,
                indices::as_index_array(&pair.1, Some(device))?,
            )
        } else {
            (
                index_tensor(py, &pair.0, true)?.0,
                index_tensor(py, &pair.1, true)?.0,
            )
        };
        // The two segments of a C4 token are rows of two finer geometries over the same bytes
        // (576-byte values, 8-byte scales); the core maps each token to its row in each.
        Self::run(values.get(), &layers, &host, &dev, backend)?;
        Self::run(scales.get(), &layers, &host, &dev, backend)
    }

    /// A backup (`Layers::All`) or a load of one layer by slots: whole pages as page rows,
    /// anything else token by token.
    fn slots(
        &self,
        py: Python<'_>,
        host: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
        io_backend: &Bound<'_, PyAny>,
        layers: Layers<'_>,
        page_aligned_only: bool,
    ) -> PyResult<()> {
        let Some((host, dev, n)) = self.indices(host, device)? else {
            return Ok(());
        };
        let whole_pages = n % self.page_size.max(1) == 0;
        self.check_device(py, whole_pages || !page_aligned_only, n)?;
        let io = io_backend
            .cast::<PyString>()
            .ok()
            .map(|s| s.to_cow().map(|c| c.into_owned()))
            .transpose()?;
        if !whole_pages {
            let backend = self.backend(py, io_backend, "tokens")?;
            let io = io.as_deref().unwrap_or("");
            return self.tokens(py, io, backend.as_any(), (host, dev), layers);
        }
        // Before the early return below: a release without kernel_ascend refuses it first.
        let backend = self.backend(py, io_backend, "slots")?;
        let ascend = io.as_deref() == Some("kernel_ascend");
        if ascend && matches!(layers, Layers::All) && self.spec()?.spec.layers == 0 {
            return Ok(()); // SGLang checks the layout in each layer's page view: there are none
        }
        let binding = match (&self.ascend, &self.page) {
            (Some(ascend_rows), _) if ascend => ascend_rows,
            (_, Some(page)) => page,
            _ => return Err(self.no_rows()),
        };
        let Some(layers) = self.checked_layers(py, layers)? else {
            return Ok(()); // a pool without layers has nothing to back up
        };
        if !self.has_rows {
            return Err(self.no_rows());
        }
        Self::run(binding.get(), &layers, &host, &dev, backend.as_any())
    }
}

#[pymethods]
impl PyV4Transfers {
    #[new]
    #[pyo3(signature = (name, page_size, item_bytes, device, *, spec = None, page = None, ascend = None, tokens = None, refusal = None, has_rows = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        page_size: usize,
        item_bytes: u64,
        device: &Bound<'_, PyAny>,
        spec: Option<Py<PyPoolSpec>>,
        page: Option<Py<PyDeviceBinding>>,
        ascend: Option<Py<PyDeviceBinding>>,
        tokens: Option<(Py<PyDeviceBinding>, Py<PyDeviceBinding>)>,
        refusal: Option<String>,
        has_rows: bool,
    ) -> PyResult<Self> {
        Ok(Self {
            name,
            page_size,
            item_bytes,
            spec,
            page,
            ascend,
            tokens,
            refusal,
            device_type: device.getattr("type")?.str()?.to_cow()?.into_owned(),
            device: device.clone().unbind(),
            has_rows,
        })
    }

    /// Every layer, device -> host. `page_aligned_only` is the pool's flag as it is at the call
    /// (SGLang's unit tests set it on pools they build by hand).
    #[pyo3(signature = (host_indices, device_indices, io_backend, *, page_aligned_only = false))]
    fn backup(
        &self,
        py: Python<'_>,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        io_backend: &Bound<'_, PyAny>,
        page_aligned_only: bool,
    ) -> PyResult<()> {
        let (h, d, layers) = (host_indices, device_indices, Layers::All);
        self.slots(py, h, d, io_backend, layers, page_aligned_only)
    }

    /// Host layer `layer_id` -> device.
    #[pyo3(signature = (layer_id, host_indices, device_indices, io_backend, *, page_aligned_only = false))]
    fn load(
        &self,
        py: Python<'_>,
        layer_id: &Bound<'_, PyAny>,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        io_backend: &Bound<'_, PyAny>,
        page_aligned_only: bool,
    ) -> PyResult<()> {
        let (h, d, layers) = (host_indices, device_indices, Layers::One(layer_id.clone()));
        self.slots(py, h, d, io_backend, layers, page_aligned_only)
    }

    /// Every layer of single tokens, device -> host (SGLang 0.5.23's HiSparse decode backup):
    /// each token's C4 value and scale, whatever the index count, so a multiple of the page size
    /// is never taken for whole pages. A page-aligned-only pool refuses it.
    #[pyo3(signature = (host_indices, device_indices, *, page_aligned_only = false))]
    fn backup_tokens(
        &self,
        py: Python<'_>,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        page_aligned_only: bool,
    ) -> PyResult<()> {
        let Some((host, dev, n)) = self.indices(host_indices, device_indices)? else {
            return Ok(());
        };
        self.check_device(py, !page_aligned_only, n)?;
        // SGLang moves these tokens with its DSV4 kernel, which needs per-layer host rows.
        let kernel = PyString::new(py, "kernel");
        let backend = self.backend(py, kernel.as_any(), "tokens")?;
        self.tokens(py, "kernel", backend.as_any(), (host, dev), Layers::All)
    }

    /// Drops the bindings' cores (the pool was destroyed).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let tokens = self.tokens.iter().flat_map(|(v, s)| [v, s]);
        for binding in self.page.iter().chain(&self.ascend).chain(tokens) {
            binding.get().release(py)?;
        }
        Ok(())
    }
}
