//! `_core.LayerMap`: the controller layer ids of a pool that has no device binding yet (built
//! from a device pool's geometry alone, SGLang <= 0.5.21 or MLA `is_dummy`): the same lookups a
//! `DeviceBinding` answers, so the Python pools ask one object either way.

use pyo3::prelude::*;

use super::binding::layer_key;
use super::errors::to_py;
use crate::layer_map::LayerMap;

#[pyclass(name = "LayerMap", module = "hostkv_rs._core", frozen)]
pub struct PyLayerMap {
    layers: LayerMap,
}

#[pymethods]
impl PyLayerMap {
    /// The owned target layers `owned_slots` (controller ids, in host-layer order) of a pool of
    /// `target_layer_num` host layers, without drafts.
    #[new]
    fn new(py: Python<'_>, owned_slots: Vec<i64>, target_layer_num: usize) -> PyResult<Self> {
        let layers = LayerMap::new(
            owned_slots.len(),
            &owned_slots,
            0,
            target_layer_num,
            None,
            "layer map",
        )
        .map_err(|e| to_py(py, e))?;
        Ok(Self { layers })
    }

    /// The host layer of controller layer `layer_id`, None for a target layer not held; a
    /// draft is refused (`LayerIndexError`).
    #[pyo3(signature = (layer_id, is_draft = false))]
    fn lookup(
        &self,
        py: Python<'_>,
        layer_id: &Bound<'_, PyAny>,
        is_draft: bool,
    ) -> PyResult<Option<usize>> {
        let key = layer_key(layer_id)?;
        Ok(self
            .layers
            .lookup(key, is_draft)
            .map_err(|e| to_py(py, e))?
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
}
